# Copyright 2026 The fisher_optax Authors. Licensed under the Apache License 2.0.
"""The fast layer-statistics path: per-example statistics without B x P.

A dense layer computes ``z = a @ W (+ b)``. For example ``n`` (and output
cotangent ``s``), its gradient is ``g = a_n^T delta_{s,n}`` where ``delta`` is
the cotangent at the pre-activation ``z``. Diagonal Fisher, K-FAC factors,
per-example norms and the per-example Gram matrix are all cheap functions of
``a`` and ``delta``:

.. math::

  \\mathrm{diag}(W) = \\sum_{s,n} (a_n^2)^\\top \\delta_{s,n}^2, \\quad
  A = \\sum_n a_n a_n^\\top, \\quad \\Gamma = \\sum_{s,n} \\delta_{s,n}
  \\delta_{s,n}^\\top, \\quad
  \\langle g_i, g_j \\rangle = (a_i \\cdot a_j)(\\delta_i \\cdot \\delta_j).

``delta`` comes from the zero-"tap" trick: add a zero array to every dense
output and differentiate the model's outputs with respect to the taps. Row
``n`` of a tap only touches example ``n``'s outputs, so the tap cotangents are
the per-example ``delta`` for all examples at once, at the cost of one backward
pass per cotangent (one at a time for the diagonal and the K-FAC sums, whose
memory then does not grow with ``S``; vmapped over the ``S`` cotangents for the
other statistics).

**How layers are found.** No model edits and no Flax hooks: the apply function
is traced to a jaxpr and generic patterns are matched on it, whatever module
produced them, so the same code serves Flax Linen (``model.apply``), Flax NNX
(an ``nnx.merge`` function) and plain functions. A parameter leaf is
*covered* when each of its uses is one of

* an operand of a ``dot_general`` whose other operand is an activation
  ``x`` with the examples on axis 0: any contraction of feature axes of ``x``
  with axes of the N-D kernel, no ``dot_general`` batch axes (below); the
  other axes of ``x`` (positions) are weight-shared (``x @ W``,
  ``jnp.einsum``, Linen ``Dense``/``DenseGeneral``/``Einsum``, the
  ``(d, heads, head_dim)`` and ``(heads, head_dim, d)`` kernels of
  ``MultiHeadDotProductAttention``, NNX
  ``Linear``/``LinearGeneral``/``MultiHeadAttention``; the kernel may be a
  transposed leaf, as in a head tied to the embedding, ``Embed.attend``,
  ``x @ table.T``). Diagonal and Gram
  are exact; the example gradient is the ``(K, O)`` matrix
  ``sum_t x_t delta_t^T`` (contracted axes ``K``, kernel free axes ``O``)
  mapped back to the kernel's axis order;
* the kernel of a ``dot_general`` with batch axes shared with the
  activation, the examples on the activation's axis 0 and not a batch axis
  (per-head or per-expert kernels, ``bhtd,hde->bhte``): every batch index is
  its own dense layer, and the example gradient ``(H, K, O)`` contracts the
  example's activations with its ``delta`` over the positions per head.
  Like a conv kernel's, its statistics are formed from these gradients a
  chunk of examples at a time (exact), and its K-FAC factors are per head
  (below);
* a leaf reshaped or broadcast over the leading axes and added to such a
  product that has no other consumer (its bias, N-D for ``DenseGeneral``);
* the table of a row ``gather`` (``jnp.take(table, ids, axis=0)``,
  ``table[ids]``, Linen/NNX ``Embed``);
* an elementwise scale ``y = x * p`` or shift ``y = x + p`` with ``p`` a leaf
  broadcast along the example axis (and possibly others): ``LayerNorm`` and
  ``RMSNorm`` scales and biases, learned positional parameters, a bias whose
  product has other consumers. The output ``y`` is tapped; the example
  gradient is ``x * delta`` (scale) or ``delta`` (shift) summed over the
  broadcast axes;
* a leaf (or a view of it) times a constant, one that depends on neither
  the inputs nor the parameters, computed in the same jaxpr as the layer
  using the product: an elementwise scale ``x * (p * c)`` (a BatchNorm
  with running statistics, ``c = rsqrt(var + eps)``) and a kernel times a
  scalar (``x @ (W * 0.5)``, a muP-style multiplier). The layer records
  ``x * c`` as its activation, ``x * (c * p) = (x * c) * p``, so every
  statistic is exact (a kernel times a mask: below);
* the kernel of a ``conv_general_dilated`` whose input (the lhs) has the
  examples on axis 0, as does its output: any dimension numbers (Flax's
  ``NHWC``/``HWIO``), strides, padding, lhs/rhs dilation and feature groups
  (grouped and depthwise convs), ``batch_group_count == 1`` (Linen/NNX
  ``Conv``, a ViT patch embedding). The output is tapped and the example
  gradient contracts the example's input patches (strided slices of its
  padded input, ``(positions, window, I)``) with its ``delta`` over the
  output positions, per feature group; every statistic of the kernel is
  formed from these gradients for a chunk of examples at a time (as for
  shared leaves below), so diagonal, Gram matrix and norms are exact with
  memory ``chunk_size`` times the kernel plus one example's patches. Its
  bias (added after the conv, broadcast over the spatial axes) is an
  elementwise shift.

**Values computed from parameters.** An operand of these layers (a kernel,
an elementwise scale or shift) that depends on parameters and constants
only, through any equations (``WeightNorm``'s ``g * v / |v|``,
``SpectralNorm``'s power iteration, a weight-standardised conv kernel, a
kernel times a mask, merged LoRA weights ``W0 + A @ B``, ``softplus(p)``,
``exp(t)``; jitted functions and ``jit`` boundaries included), is a
*derived* value ``D``. The walk records the equations computing ``D`` and
reads their inputs (the leaves, possibly cast, and constants) in the
forward pass; the layer gives ``D``'s per-example gradients ``G_n`` (as for
a leaf), and each leaf's are ``J^T G_n``, a VJP of those equations per
example, formed for a chunk of examples at a time like a shared leaf's
(leaves used only through the same value of a conv or per-head kernel,
a WeightNorm conv's direction and scale, share one such pass).
Diagonal, Gram matrix, weighted sums and norms are exact; K-FAC factors do
not exist for these leaves. In a scan's body (a WeightNorm layer of an
``nn.scan`` stack) the value is computed per iteration from the leaves the
scan slices: its inputs leave the re-run scan stacked, ``(L, ...)``, and
the program runs per layer under ``vmap``; from leaves the scan shares (a
``variable_broadcast`` stack) it is one value for every iteration, a layer
shared by them. Not covered: a value entering a scan, one computed in a
scan from leaves it slices and leaves it shares, in nested scans, or under
``shard_map`` from parameters that are device-invariant, where the VJP of
the value would sum the devices' cotangents and mix their examples. The
estimators' ``axis_name`` makes the parameters vary per device, so under
``shard_map`` with it such values are covered (a batch-sharded ``jit`` needs
nothing).

Casts (``convert_element_type``) and ``jit``/``remat`` boundaries are looked
through, and ``scan`` bodies are walked (below). A leaf used any other way
(a leaf in a ``scan`` carry with the activations, a ``custom_jvp`` of the
activations) is not covered; the engine computes it by the per-example
path, and :func:`coverage` says which path each leaf takes and why.

**Scans.** A leaf entering a ``scan`` (``lax.scan``, Linen ``nn.scan``,
``nnx.scan``; ``remat`` inside or around it) as an ``xs`` operand is a stack
of layers ``(L, ...)``, iteration ``l`` using slice ``l``: the scan is re-run
with the taps of the layers in its body as extra ``xs`` and their
activations returned as extra ``ys`` (``reverse``, ``length``, ``unroll``
kept), so every statistic of the leaf comes out per slice with its leading
``L`` axis (the Gram matrix sums the slices). A leaf entering as a const is
shared by the iterations (a recurrent cell): its iterations are positions
of a weight-shared layer below (a conv kernel's per-example gradient sums
its iterations' patch contractions; no K-FAC factors). Nested scans combine
both. A ``remat`` body holding layers is re-run under ``jax.checkpoint``
with its policy.

Recording every iteration's ``(a, delta)`` costs ``(L, B, T, K)`` memory
per stacked layer, several times the batch gradient's (which keeps one
carry per iteration under ``remat``). When the caller needs one statistic,
``record(statistic="diag" | "kron" | "gram")`` forms it inside the
backward pass instead: a stacked layer's output passes through an identity
whose ``custom_vjp`` also returns, as the cotangent of a zero "statistic
tap", that iteration's diagonal, K-FAC ``Gamma`` sums or ``(B, B)`` Gram
matrix from the (recomputed) ``a`` and the ``delta`` just formed; K-FAC's
``A`` sums, which need no ``delta``, form in the forward pass, once however
many backward passes follow. Nothing of size ``B x T`` leaves the
iteration, so the pass needs about the batch gradient's memory (a stacked
conv's diagonal and K-FAC sums likewise; its Gram matrix and weighted sums
come from the recorded layer). A low-rank Fisher's weighted sums ``sum_n
w_kn g_n`` need weights known only after the Gram matrix: a second pass,
``record(statistic="combine", weights=w)``, carries them into the backward
pass on its taps. (Outside scans this brought nothing on XLA:CPU: the
layers' ``(a, delta)`` are recorded as before.)

**Shared leaves.** A leaf with several uses (a head tied to the embedding
table, a kernel applied twice, a stacked kernel used twice per iteration)
has the per-example gradient ``g_n = sum_u g_{u,n}`` of its uses ``u``.
Its statistics form ``g_n`` from each use's ``(a, delta)`` for a chunk of
examples at a time (``chunk_size``); the Gram matrix pairs every two chunks,
so no more than two chunks of gradients are held at once.

**K-FAC factors** exist for a dense kernel whose contracted axes lead and
whose output axes trail, viewed as the matrix ``(K, O)`` (``Dense``,
``DenseGeneral``, attention ``q``/``k``/``v`` kernels ``(d, heads,
head_dim)`` as ``(d, heads * head_dim)`` and output projections ``(heads,
head_dim, d)`` as ``(heads * head_dim, d)``), for embeddings and for
biases of any shape (``(1, O)``), also when shared by a scan's iterations,
and per layer for a leaf stacked along a scan (factors ``(L, K, K)``,
``(L, O, O)``). Elementwise parameters have none, nor have leaves shared by
several uses; :func:`fisher_optax.fisher.kronecker` gives them Shampoo factors
from per-example gradients, an elementwise leaf's formed here
(:meth:`LayerGrads.example_grads`: ``x * delta`` or ``delta`` summed over
the broadcast positions; inside the backward pass under
``record(statistic="kron")``). A convolution kernel in the ``(spatial..., I,
O)`` layout (Flax's ``HWIO``) with one feature group has factors in its
matrix view ``(prod(spatial) * I, O)``: ``a`` its input patches, the
output positions weight-shared (Grosse & Martens, 2016), per layer when
stacked along a scan; grouped convs and other kernel layouts have none. A
per-head kernel ``(H, K, O)`` (batch axes, then contracted, then free) has
factors per head, ``(H, K, K)`` and ``(H, O, O)``, each the dense rule on
that head's activations and cotangents (``ConvLocal``: per position).

**Weight sharing.** When the activation has middle axes (a dense layer applied
to ``(B, T, d)``), the example gradient is ``sum_t a_t delta_t^T``. Norms and
the Gram matrix keep a cheap exact form
(:math:`\\langle a a^\\top, \\delta \\delta^\\top \\rangle`, "ghost norms"); the
exact diagonal does not: it accumulates the squares of per-example products
(on CPU a scan of one matmul per example; elsewhere chunked batched
einsums). The K-FAC factors use the "expand" convention (positions as examples) by
default: ``A_sum = sum_n mean_t a_t a_t^T`` and
``Gamma_sum = sum_{s,n,t} delta delta^T``; ``weight_sharing="reduce"``
sums over the positions first: ``A_sum = sum_n abar_n abar_n^T`` with
``abar_n = mean_t a_t``, ``Gamma_sum = sum_{s,n} (sum_t delta)(sum_t
delta)^T``. Either way ``(A_sum / B) kron (Gamma_sum / B)`` is the exact
block when ``T = 1`` (for ``kind="exact"``, the exact Fisher's); with
``T > 1`` neither is exact: "expand" suits layers whose positions act as
independent examples (a language model's per-token loss), "reduce" those
whose positions are pooled before the loss (Eschenhagen et al, 2023).

**Sharding.** Under ``shard_map`` (any axis type) taps vary per device like
their layer outputs, so statistics are local sums to ``psum``. A global-view
``jit`` with a batch-sharded input works on ``Auto`` mesh axes; on
``Explicit`` axes the batch contractions would need an ``out_sharding`` that
this module does not pass yet (use ``shard_map`` there).

**Assumptions.** The model is batch independent (output row ``n`` depends on
input row ``n`` only: no BatchNorm in training mode), and an activation whose
leading axis has the batch size carries the batch on that axis. Both hold for
the usual models; the per-example path needs the first one too.

Ordering: statistics indexed by ``i`` run over ``i = s * B + n``.

**One pass.** :func:`record` traces the model once with taps in place; a
caller that also needs the outputs and the batch gradient shares that
forward pass (and, for the empirical Fisher, one backward pass):

>>> import jax.numpy as jnp
>>> from fisher_optax.fisher import _taps
>>> apply_fn = lambda p, x: x @ p["w"] + p["b"]
>>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
>>> tape = _taps.record(apply_fn, params, jnp.ones((4, 3)))  # taps in place
>>> r = tape.outputs - 1.0  # d loss / d outputs, (B, *out)
>>> grad_sum, layer_grads = tape.gradient(r)  # one backward: grad + delta
>>> layer_grads.statistics("diag")["w"].shape  # sum_n g_n^2
(3, 2)
>>> more = tape.backward(jnp.stack([r, -r]))  # S more cotangents, vmapped
>>> more.statistics("gram").shape  # <g_i, g_j>, i = s * B + n
(8, 8)

References:
  Goodfellow, `Efficient per-example gradient computations
  <https://arxiv.org/abs/1510.01799>`_, 2015.

  Li et al, `Large language models can be strong differentially private
  learners <https://arxiv.org/abs/2110.05679>`_, 2021 (ghost norms).

  Grosse & Martens, `A Kronecker-factored approximate Fisher matrix for
  convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016.

  Eschenhagen et al, `Kronecker-factored approximate curvature for modern
  neural network architectures <https://arxiv.org/abs/2311.00636>`_, 2023.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
import dataclasses
import functools
import math
import os
import sys
from typing import Any, NamedTuple
import warnings

import jax
from jax import lax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from fisher_optax.fisher import numerics
from fisher_optax.fisher import validation

Array = jax.Array
PyTree = Any

STRUCTURES = ("diag", "kron", "gram")
# Statistics a tape can form inside the backward pass (record(statistic=)).
FUSED_STATISTICS = ("diag", "kron", "gram", "combine")

# K-FAC conventions for weight-shared layers (Eschenhagen et al, 2023).
WEIGHT_SHARING = ("expand", "reduce")

# Call-like primitives whose body is looked into (and inlined when it holds a
# tapped layer), with the name of the parameter holding the body.
_CALLS = {
  "jit": "jaxpr",
  "pjit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "checkpoint": "jaxpr",
  "remat": "jaxpr",
  "remat2": "jaxpr",
}

# Value-preserving unary primitives looked through: casts, and the
# device-variance casts shard_map inserts for replicated parameters.
_PASS_THROUGH = ("convert_element_type", "pvary", "pcast", "copy", "copy_p")

# Kinds of walked values that are (views of) a parameter leaf; "perm" is a
# transposed leaf, usable as a dot_general kernel only.
_PARAM_KINDS = ("param", "view", "perm", "scaled")

# Site kinds of elementwise parameters (norm scales and shifts, positions).
_ELEMENTWISE = ("scale", "shift")
# Site kinds whose statistics always come from per-example gradients formed
# a chunk of examples at a time, the layer's own layout kept (no cheap
# (a, delta) form): convolutions and per-head kernels.
_CHUNKED = ("conv", "bdense")
# Sites whose per-example gradients record(ordered=True) can form for "gram".
_GRADS_KINDS = ("conv", "dense", "scale", "shift")

# Budget (elements) for a materialised chunk of per-example layer gradients
# when the caller gives no chunk size (weight-shared diagonal, shared leaves).
DEFAULT_CHUNK_ELEMENTS = 1 << 24
# Recorded activations and cotangents of one backward pass (held_elements)
# above which the estimators split the examples of several-sample kinds
# into chunks. Smaller chunks cost time: the benchmark transformer's exact
# diagonal at B=128 took 16% longer in chunks of 64 examples than in one.
PASS_ELEMENTS = 1 << 25
# Per-layer intermediates of the Gram matrix and of weighted sums that grow
# with the batch (input blocks, example chunks); XLA may hold several
# layers' at once.
_BLOCK_ELEMENTS = 1 << 22
# Conv input patches per chunk: a chunk's patches and gradients stay in
# cache (on XLA:CPU, 10x the rows in one chunk ran 25x slower).
_PATCH_CHUNK_ELEMENTS = 1 << 20


# --------------------------------------------------------------------------
# Matching layers on the jaxpr.


@dataclasses.dataclass
class _Site:
  """A matched layer: a product, an embedding gather or an elementwise op.

  ``kind`` is ``"dense"`` (a ``dot_general`` with a parameter operand),
  ``"embed"`` (a row gather of a table), ``"scale"`` (``x * p``) or
  ``"shift"`` (``x + p``), ``"conv"`` (a ``conv_general_dilated`` with a
  parameter kernel) or ``"bdense"`` (a ``dot_general`` with batch axes
  shared by the kernel and the activation: per-head kernels). ``act_index``
  is the equation operand recorded as the activation (the other operand of
  a product, the ids of a gather).
  """

  kind: str
  path: tuple[int, ...]  # equation indices from the top-level jaxpr down
  kernel: int  # leaf index of the kernel / table / elementwise parameter
  act_index: int = 0
  bias: int | None = None  # leaf index of the bias, if matched (dense)
  mode: Any = None  # gather mode (embed)
  num_rows: int = 0  # vocabulary size (embed)
  # dense: the activation as (B, T, K) is x.transpose(x_perm); the output
  # as (B, T, O) is out.transpose(out_perm); the (K, O) statistic is the
  # kernel transposed by leaf_perm (contracting axes, then free axes).
  x_perm: tuple[int, ...] = ()
  out_perm: tuple[int, ...] = ()
  leaf_perm: tuple[int, ...] = ()
  num_free: int = 0  # the kernel's free (output) axes
  heads: int = 0  # bdense: the dot_general's batch axes (per-head kernels)
  # scale / shift: the parameter broadcast from this shape (same size as
  # the leaf, ones where it is broadcast) to the output's.
  compact: tuple[int, ...] = ()
  # conv: the convolution equation (its layouts, strides, padding, groups)
  eqn: Any = None
  # the parameter enters times a constant, (c, shape): c a jaxpr variable
  # or literal of the site's jaxpr, broadcast to shape (the product's):
  # the recorded activation is x * c
  factor: Any = None
  # the operand is a value computed from parameters (WeightNorm, softplus,
  # a mask): the index of its program in _Plan.derived
  derived: int | None = None
  # the operand is the leaf itself, not a transposed or scaled view of it:
  # only then is the leaf's gradient the operand's cotangent
  direct: bool = True


@dataclasses.dataclass
class _Derived:
  """A value that depends on parameters and constants only (not on the
  inputs), as the equations computing it: a WeightNorm kernel ``scale * v
  / |v|``, ``softplus(p)``, a kernel times a mask, merged LoRA weights.

  A layer using it gives the per-example gradient ``G_n`` of the value;
  the leaves' are ``J^T G_n`` (a VJP of these equations at the recorded
  inputs, one per example). Variables are ``(jaxpr path, var)``: the
  equations may lie in the layer's jaxpr and the calls around it, a call
  body's operand ``links`` to the caller's variable. ``inputs`` are the
  leaves (``leaves[i]`` their index; possibly cast) and the non-literal
  constants (``None``), read in the forward pass after the program's last
  equation in their jaxpr.
  """

  eqns: list[tuple[tuple[int, ...], Any]]  # (path, equation), in order
  inputs: list[tuple[tuple[int, ...], Any]]
  leaves: list[int | None]
  links: dict[tuple[tuple[int, ...], Any], tuple[tuple[int, ...], Any]]
  out: tuple[tuple[int, ...], Any]  # the variable the layer uses
  # inside a scan's body (its leaves sliced by it): the scan's length; the
  # inputs are read per iteration, stacked, and the program maps over them
  length: int | None = None
  # inside a scan's body from leaves the scan shares: the same value in
  # every iteration (a layer shared by them); inputs read in the first
  first: bool = False

  @property
  def shape(self) -> tuple[int, ...]:
    """The value's shape, with a leading ``length`` axis in a scan."""
    lead = () if self.length is None else (self.length,)
    return lead + tuple(self.out[1].aval.shape)

  def run(self, values: Sequence[Any]) -> Array:
    """The value from its inputs' values (in ``inputs`` order)."""
    env = dict(zip(self.inputs, values))

    def read(scope, v):
      if isinstance(v, jex.Literal):
        return v.val
      while (scope, v) in self.links:
        scope, v = self.links[scope, v]
      return env[scope, v]

    for scope, eqn in self.eqns:
      outs = _bind(eqn, [read(scope, v) for v in eqn.invars])
      env.update(((scope, v), x) for v, x in zip(eqn.outvars, outs))
    return read(*self.out)

  def leaf_vjp(self, values: Sequence[Any], leaves: Sequence[int]) -> Callable:
    """``G -> (J_k^T G for k in leaves)``, one pullback for all of them (each
    leaf's inputs' cotangents summed, widened)."""
    idx = [
      [i for i, k in enumerate(self.leaves) if k == leaf] for leaf in leaves
    ]
    flat = [i for ix in idx for i in ix]

    def one(values, *xs):
      ins = list(values)
      for i, x in zip(flat, xs):
        ins[i] = x
      return self.run(ins)

    # in a scan, one program per iteration (every input stacked)
    run = one if self.length is None else jax.vmap(one)
    out, pull = jax.vjp(
      functools.partial(run, list(values)), *(values[i] for i in flat)
    )
    ends = np.cumsum([0] + [len(ix) for ix in idx])

    def apply(g):
      cts = pull(jnp.asarray(g).astype(out.dtype))
      return tuple(
        sum(numerics.widen(c) for c in cts[a:b])
        for a, b in zip(ends[:-1], ends[1:])
      )

    return apply


@dataclasses.dataclass
class _Plan:
  sites: list[_Site]
  roles: list[tuple[int, str] | None]  # per leaf: (site, role) or None
  site_at: dict[tuple[int, ...], int]  # equation path -> site index
  inline: set[tuple[int, ...]]  # call equations to inline
  reasons: list[str] = dataclasses.field(default_factory=list)  # per leaf
  # scan equation path -> the sites in its body (re-run with stacked taps)
  loops: dict[tuple[int, ...], list[int]] = dataclasses.field(
    default_factory=dict
  )
  # site -> lengths of the scans around it, outermost first
  site_loops: dict[int, tuple[int, ...]] = dataclasses.field(
    default_factory=dict
  )
  # covered leaf with several uses or sliced by a scan -> its uses as
  # (site, role, modes): per enclosing scan, "xs" (sliced) or "const"
  special: dict[int, list[tuple[int, str, tuple[str, ...]]]] = (
    dataclasses.field(default_factory=dict)
  )
  # programs of the values computed from parameters that sites use, and
  # equation path -> (program, input) read after it
  derived: list[_Derived] = dataclasses.field(default_factory=list)
  capture: dict[tuple[int, ...], list[tuple[int, int]]] = dataclasses.field(
    default_factory=dict
  )
  # leaves apply_fn never reads (or zero-size): zero statistics, whatever
  # path computes them (the per-example path's VJP is zero, no work)
  unused: set[int] = dataclasses.field(default_factory=set)

  def uses(self, leaf: int) -> list[tuple[int, str, tuple[str, ...]]]:
    """A covered leaf's uses as (site, role, modes); [] if not covered."""
    r = self.roles[leaf]
    if r is None:
      return []
    return self.special.get(leaf, [(r[0], r[1], ())])

  def layer_axes(self, leaf: int) -> int:
    """The leading layer axes of a leaf with one use: one per scan around
    it (all slicing it for a leaf whose statistic is fused)."""
    return len(self.uses(leaf)[0][2])


def _open_jaxpr(sub: Any) -> tuple[Any, Sequence[Any]] | None:
  """(open jaxpr, consts) of a closed or open jaxpr parameter, else None."""
  if isinstance(sub, jex.ClosedJaxpr):
    return sub.jaxpr, sub.consts
  if isinstance(sub, jex.Jaxpr):
    return sub, ()
  return None


def _sub_jaxpr(eqn) -> tuple[Any, Sequence[Any]] | None:
  """Returns (open jaxpr, consts) of a call-like equation, else None."""
  name = _CALLS.get(eqn.primitive.name)
  if name is None or name not in eqn.params:
    return None
  return _open_jaxpr(eqn.params[name])


def _call_body(eqn) -> tuple[Any, Sequence[Any]]:
  """(open jaxpr, consts) of an equation known to be a call."""
  sub = _sub_jaxpr(eqn)
  if sub is None:
    raise ValueError(f"{eqn.primitive.name} is not a call-like equation.")
  return sub


def _var_uses(jaxpr) -> dict[Any, int]:
  counts: dict[Any, int] = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if isinstance(v, jex.Var):
        counts[v] = counts.get(v, 0) + 1
  for v in jaxpr.outvars:
    if isinstance(v, jex.Var):
      counts[v] = counts.get(v, 0) + 1
  return counts


def _dense_layout(eqn, act: int, batch: int) -> dict | None:
  """The permutations of a ``dot_general`` of an activation and a kernel.

  Operand ``act`` is the activation ``x`` (batch on its axis 0), the other
  the parameter ``W``. Any contraction of feature axes of ``x`` with axes of
  ``W`` qualifies (no ``dot_general`` batch axes); the remaining axes of
  ``x`` after the example axis are weight-shared positions.
  """
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  if lb or rb:
    return None
  cx, cw = (lc, rc) if act == 0 else (rc, lc)
  x, w = eqn.invars[act].aval, eqn.invars[1 - act].aval
  if len(x.shape) < 2 or x.shape[0] != batch or 0 in cx or not cx:
    return None
  fx = [i for i in range(len(x.shape)) if i not in cx]
  fw = [i for i in range(len(w.shape)) if i not in cw]
  # Output axes: lhs free axes, then rhs free axes; as (B, T, O) the
  # activation's come first.
  nx, nw = len(fx), len(fw)
  if act == 0:
    out_perm = tuple(range(nx + nw))
  else:
    out_perm = tuple(range(nw, nw + nx)) + tuple(range(nw))
  return {
    "x_perm": tuple(fx) + tuple(cx),
    "out_perm": out_perm,
    "leaf_perm": tuple(cw) + tuple(fw),
    "num_free": nw,
  }


def _batched_layout(eqn, act: int, batch: int) -> dict | None:
  """The permutations of a ``dot_general`` with batch axes (``bhtd,hde->
  bhte``: per-head or per-expert kernels), the kernel operand ``1 - act``.

  The activation has the examples on its axis 0, not a batch axis; as
  ``(B, H, T, K)`` it is ``x.transpose(x_perm)`` (batch axes ``H``, other
  free axes ``T``, contracted ``K``); the output (batch axes first) as
  ``(B, H, T, O)`` is ``out.transpose(out_perm)``; the per-example ``(H, K,
  O)`` statistic is the kernel transposed by ``leaf_perm``.
  """
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  if not lb:
    return None
  cx, cw = (lc, rc) if act == 0 else (rc, lc)
  bx, bw = (lb, rb) if act == 0 else (rb, lb)
  x, w = eqn.invars[act].aval, eqn.invars[1 - act].aval
  if x.shape[:1] != (batch,) or 0 in cx or 0 in bx or not cx:
    return None
  fx = [i for i in range(len(x.shape)) if i not in cx and i not in bx]
  fw = [i for i in range(len(w.shape)) if i not in cw and i not in bw]
  nb, nx, nw = len(bx), len(fx), len(fw)
  ex = nb if act == 0 else nb + nw  # the example axis in the output
  rest = [ex + 1 + i for i in range(nx - 1)]  # its other free axes
  own = (
    [nb + nx + i for i in range(nw)]
    if act == 0
    else [nb + i for i in range(nw)]
  )
  return {
    "x_perm": (0, *bx, *fx[1:], *cx),
    "out_perm": (ex, *range(nb), *rest, *own),
    "leaf_perm": (*bw, *cw, *fw),
    "num_free": nw,
    "heads": nb,
  }


def _is_embed(eqn, batch: int) -> bool:
  table, idx = (v.aval for v in eqn.invars)
  if len(table.shape) != 2 or len(idx.shape) < 2 or idx.shape[0] != batch:
    return False
  if idx.shape[-1] != 1 or not jnp.issubdtype(idx.dtype, jnp.integer):
    return False
  dn = eqn.params["dimension_numbers"]
  return (
    tuple(dn.offset_dims) == (len(idx.shape) - 1,)
    and tuple(dn.collapsed_slice_dims) == (0,)
    and tuple(dn.start_index_map) == (0,)
    and not tuple(dn.operand_batching_dims)
    and tuple(eqn.params["slice_sizes"]) == (1, table.shape[1])
  )


def _view_of(eqn, kind) -> tuple | None:
  """``("view", leaf, compact)`` for a reshape/broadcast of a parameter.

  ``compact`` is the leaf's shape with size-one axes inserted (same size,
  same element order); the value is ``compact`` broadcast to the output.
  """
  if kind is None or kind[0] not in ("param", "view", "scaled"):
    return None
  src, out = eqn.invars[0].aval, eqn.outvars[0].aval
  compact = tuple(src.shape) if kind[0] == "param" else kind[2]
  head = ("view", kind[1]) if kind[0] != "scaled" else kind[:2]
  tail = (*kind[3:5], False) if kind[0] == "scaled" else ()
  if eqn.primitive.name == "reshape":
    if eqn.params.get("dimensions") is not None or compact != src.shape:
      return None
    return (*head, tuple(out.shape), *tail)
  dims = tuple(eqn.params["broadcast_dimensions"])
  if list(dims) != sorted(set(dims)) or len(dims) != len(compact):
    return None
  new = [1] * len(out.shape)
  for i, d in enumerate(dims):
    new[d] = compact[i]
  return (*head, tuple(new), *tail)


def _scaled_param(eqn, kinds, here: tuple[int, ...], walk) -> tuple | None:
  """``p * c``, ``c`` a constant: ``("scaled", leaf, compact, (c, shape),
  scope, direct)``, ``shape`` the product's (``c`` may broadcast size-one
  axes to it), ``direct`` when ``p`` is the leaf itself (not a view).

  ``p`` is a leaf or a view of one, ``c`` depends on neither the inputs nor
  the parameters (a BatchNorm's ``rsqrt(var + eps)``, a fixed scale) and
  does not broadcast ``p``. A layer using the product records ``x * c`` as
  its activation, which is exact for every statistic of ``p``; ``scope``
  (the jaxpr holding the product) is where ``c`` can be read.
  """
  for j in (0, 1):
    p_k, c = kinds[j], eqn.invars[1 - j]
    if p_k is None or p_k[0] not in ("param", "view"):
      continue
    shape = tuple(eqn.invars[j].aval.shape)
    c_shape = tuple(c.aval.shape)
    if (
      not walk.is_const(c)
      or shape != tuple(eqn.outvars[0].aval.shape)
      or (c_shape and len(c_shape) != len(shape))
      or any(a not in (1, b) for a, b in zip(c_shape, shape))
    ):
      return None
    compact = shape if p_k[0] == "param" else p_k[2]
    factor = (c, shape)
    return ("scaled", p_k[1], compact, factor, here[:-1], p_k[0] == "param")
  return None


# A use of a value computed from parameters, in coverage's reasons.
_DERIVED = "a value computed from parameters (a VJP per example)"


def _factor(kind, here: tuple[int, ...], kernel: bool = False) -> tuple:
  """``(ok, factor)`` of a parameter operand at a layer: ``factor`` is the
  constant of a ``"scaled"`` kind (None otherwise); not ``ok`` when it is
  out of the layer's jaxpr or, for a ``kernel`` (dense, conv), not a scalar
  times the leaf itself."""
  if kind[0] != "scaled":
    return True, None
  factor, scope, direct = kind[3:6]
  ok = scope == here[:-1]
  if kernel:
    ok = ok and direct and math.prod(factor[0].aval.shape) == 1
  return ok, factor


def _leaves_of(kind) -> tuple[int, ...]:
  """The leaves a walked value is a view of, or is derived from."""
  if kind is not None and kind[0] in _PARAM_KINDS:
    return (kind[1],)
  if kind is not None and kind[0] == "derived":
    return kind[1]
  return ()


@dataclasses.dataclass
class _Walk:
  """Matching state shared by the recursive walk over (sub-)jaxprs.

  ``uses[leaf]`` lists every use of a parameter leaf as ``(role, site,
  what)``; a leaf is covered when its only use is one matched role.
  """

  batch: int
  plan: _Plan
  uses: list[list[tuple[str, int, str]]]
  # (leaf, use index) -> per enclosing scan (outermost first) how the leaf
  # enters it: "xs" (sliced per iteration) or "const" (shared)
  modes: dict[tuple[int, int], tuple[str, ...]] = dataclasses.field(
    default_factory=dict
  )
  # variables that depend on neither the inputs nor the parameters (the
  # jaxpr's consts: a BatchNorm's running statistics, masks, literals)
  consts: set = dataclasses.field(default_factory=set)
  # Values computed from parameters: (jaxpr path, variable) -> (equation
  # index, equation) for views and derived values; a call body's operand
  # -> the caller's (path, variable); jaxpr path -> its kinds (env).
  producer: dict = dataclasses.field(default_factory=dict)
  alias: dict = dataclasses.field(default_factory=dict)
  envs: dict = dataclasses.field(default_factory=dict)
  loop_depth: int = 0  # scans around the jaxpr being walked
  # scan equation path -> (length, {leaf: "xs" | "const"}) of the leaves
  # entering it
  loop_scopes: dict = dataclasses.field(default_factory=dict)
  # inside shard_map, parameters that do not vary over the manual mesh axes
  # the examples vary over: a VJP of values computed from them would sum the
  # devices' cotangents (mixing their examples), so no derived values
  manual: bool = False

  def is_const(self, v) -> bool:
    return isinstance(v, jex.Literal) or v in self.consts

  def other(self, kind, what: str) -> None:
    """Records an opaque use of a (viewed or derived) parameter leaf."""
    for leaf in _leaves_of(kind):
      self.uses[leaf].append(("other", -1, what))

  def add_site(self, site: _Site, role: str, what: str) -> int:
    index = len(self.plan.sites)
    self.plan.sites.append(site)
    self.plan.site_at[site.path] = index
    if site.derived is None:
      self.uses[site.kernel].append((role, index, what))
    else:  # every leaf the value is computed from
      d = self.plan.derived[site.derived]
      for leaf in sorted({k for k in d.leaves if k is not None}):
        self.uses[leaf].append(("derived", index, f"{what}, {_DERIVED}"))
    return index

  def param_side(self, eqn, kinds) -> bool:
    """Whether every operand is a constant, a parameter (view) or a value
    computed from them: the outputs depend on no input."""
    return all(
      self.is_const(v)
      or (k is not None and k[0] in _PARAM_KINDS + ("derived",))
      for v, k in zip(eqn.invars, kinds)
    )

  def derive(self, eqn, kinds, env: dict, here: tuple[int, ...]) -> None:
    """Marks the outputs of a parameter-side equation as derived values."""
    leaves = {leaf for k in kinds for leaf in _leaves_of(k)}
    for v in eqn.outvars:
      if not isinstance(v, jex.DropVar):
        env[v] = ("derived", tuple(sorted(leaves)))
        self.producer[here[:-1], v] = (here[-1], eqn)

  def program(self, var, scope: tuple[int, ...]) -> int | str:
    """The program of a derived or viewed value a site at ``scope`` uses,
    as an index into ``plan.derived``, or why there is none (a variable it
    needs was made inside a call taking inputs; inside a scan, it reads
    leaves the scan slices and leaves it shares)."""
    eqns: dict[tuple[int, ...], Any] = {}  # path -> equation
    inputs, leaves, links, seen = [], [], {}, set()
    stack = [(scope, var)]
    while stack:
      key = stack.pop()
      sc, v = key
      if isinstance(v, jex.Literal) or key in seen:
        continue
      seen.add(key)
      if key in self.alias:  # a call body's operand: the caller's variable
        links[key] = self.alias[key]
        stack.append(self.alias[key])
        continue
      kind = self.envs[sc].get(v)
      made = self.producer.get(key)
      if kind is not None and kind[0] == "param":
        inputs.append(key)
        leaves.append(kind[1])
      elif made is not None:
        eqns[sc + (made[0],)] = made[1]
        stack.extend((sc, u) for u in made[1].invars)
      elif self.is_const(v):
        inputs.append(key)
        leaves.append(None)
      else:
        return "inside a call taking inputs"
    # Outer jaxprs first (their variables feed the calls), then in order.
    order = sorted(eqns, key=lambda path: (len(path), path))
    last = {path[:-1]: path for path in order}  # per jaxpr, its last one
    if not order or any(sc not in last for sc, _ in inputs):
      return "inside a call taking inputs"
    loops = [p for p in self.loop_scopes if scope[: len(p)] == p]
    length, first = None, False
    if loops:  # one scan (_derived_operand): it slices or shares the leaves
      ((length, modes),) = (self.loop_scopes[p] for p in loops)
      used = {modes.get(k) for k in leaves if k is not None}
      if used == {"const"}:  # one value for every iteration
        length, first = None, True
      elif used != {"xs"}:
        return "inside a scan, from leaves the scan slices and shares"
    index = len(self.plan.derived)
    self.plan.derived.append(
      _Derived(
        [(path[:-1], eqns[path]) for path in order],
        inputs,
        leaves,
        links,
        (scope, var),
        length,
        first,
      )
    )
    for i, (sc, _) in enumerate(inputs):
      self.plan.capture.setdefault(last[sc], []).append((index, i))
    return index


def _scan(jaxpr, env: dict, path: tuple[int, ...], walk: _Walk) -> list:
  """Walks a jaxpr, matching layers; returns the kinds of its outputs.

  ``env`` maps a variable to ``("param", leaf)`` (a leaf, possibly cast),
  ``("view", leaf, compact)`` (a reshaped or broadcast leaf) or
  ``("site", site)`` (a matched product with a single consumer chain).
  """
  counts = _var_uses(jaxpr)
  walk.consts.update(jaxpr.constvars)
  walk.envs[path] = env
  for i, eqn in enumerate(jaxpr.eqns):
    if all(walk.is_const(v) for v in eqn.invars):
      walk.consts.update(eqn.outvars)
      continue
    kinds = [env.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars]
    if not any(kinds):
      continue
    here = path + (i,)
    # Outside scans or in one, an equation of parameters and constants only
    # computes a derived value (a layer using it takes a VJP per example).
    derives = walk.loop_depth <= 1 and walk.param_side(eqn, kinds)
    if _sub_jaxpr(eqn) is not None:
      if derives and any(k and k[0] == "derived" for k in kinds):
        walk.derive(eqn, kinds, env, here)
      else:
        _scan_call(eqn, kinds, env, here, walk, derives)
    elif eqn.primitive.name == "scan":
      if derives:
        walk.derive(eqn, kinds, env, here)
      else:
        _scan_loop(eqn, kinds, env, here, walk, counts)
    elif _match(eqn, kinds, env, here, walk, counts):
      for v in eqn.outvars:  # a view's equation, for derived programs
        k = env.get(v)
        if k is not None and k[0] in _PARAM_KINDS:
          walk.producer[path, v] = (i, eqn)
    elif derives:
      walk.derive(eqn, kinds, env, here)
    else:
      for k in kinds:
        walk.other(k, f"an operand of {eqn.primitive.name}")
  return [env.get(v) if isinstance(v, jex.Var) else None for v in jaxpr.outvars]


def _scan_call(
  eqn,
  kinds: list,
  env: dict,
  here: tuple[int, ...],
  walk: _Walk,
  derives: bool = False,
):
  """Walks a call's body; the call is inlined at eval if it holds a site.

  A call of parameters and constants only (``derives``) whose body does
  more than view them (``softplus``, a jitted norm) is one derived
  equation instead: the walk of its body is undone.
  """
  inner, _ = _call_body(eqn)
  inner_env = {v: k for v, k in zip(inner.invars, kinds) if k}
  for v, o, k in zip(inner.invars, eqn.invars, kinds):
    if k is not None and k[0] not in ("param", "site"):
      walk.alias[here, v] = (here[:-1], o)  # derived programs look out
  walk.consts.update(
    v for v, o in zip(inner.invars, eqn.invars) if walk.is_const(o)
  )
  n_sites = len(walk.plan.sites)
  n_uses = [len(u) for u in walk.uses]
  out_kinds = _scan(inner, inner_env, here, walk)
  if derives and len(walk.plan.sites) == n_sites:
    opaque = any(
      len(u) > n and any(r == "other" for r, _, _ in u[n:])
      for u, n in zip(walk.uses, n_uses)
    ) or any(
      k is None or k[0] not in _PARAM_KINDS
      for k, o in zip(out_kinds, inner.outvars)
      if not walk.is_const(o)
    )
    if opaque:
      for leaf, n in enumerate(n_uses):
        del walk.uses[leaf][n:]
      walk.modes = {k: m for k, m in walk.modes.items() if k[1] < n_uses[k[0]]}
      walk.derive(eqn, kinds, env, here)
      return
  if len(walk.plan.sites) > n_sites:
    walk.plan.inline.add(here)
  for v, k, o in zip(eqn.outvars, out_kinds, inner.outvars):
    if k is not None:
      env[v] = k
      if k[0] in _PARAM_KINDS and k[0] != "param":
        walk.producer[here[:-1], v] = (here[-1], eqn)
    elif walk.is_const(o):
      walk.consts.add(v)


def _scan_loop(eqn, kinds, env, here: tuple[int, ...], walk: _Walk, counts):
  """Walks a ``scan`` body with the parameter leaves it receives.

  A leaf entering as an ``xs`` operand is sliced per iteration (a stack of
  layers, ``nn.scan``/``nnx.scan``); as a const it is shared by all the
  iterations (a recurrent cell), like a weight shared over positions. The
  uses found in the body are tagged with that mode; a leaf in the carry, or
  entering twice, is an opaque use. The scan is re-run at eval with its
  sites' taps as extra ``xs`` and their activations as extra ``ys``.
  """
  params = eqn.params
  num_consts, num_carry = params["num_consts"], params["num_carry"]
  body = params["jaxpr"].jaxpr
  entering = [k[1] for k in kinds if k is not None and k[0] in _PARAM_KINDS]
  # A scan over the examples themselves (``lax.map`` over the batch) would
  # hand the body activations without the example axis: left opaque.
  over_batch = params["length"] == walk.batch and any(
    (k is None or k[0] == "site") and v.aval.shape[:1] == (walk.batch,)
    for v, k in zip(
      eqn.invars[num_consts + num_carry :], kinds[num_consts + num_carry :]
    )
  )
  mode_of: dict[int, str] = {}
  inner_env = {}
  for j, (v, k) in enumerate(zip(body.invars, kinds)):
    carry = num_consts <= j < num_consts + num_carry
    if not carry and walk.is_const(eqn.invars[j]):
      walk.consts.add(v)  # e.g. a stack of layers' running statistics
    if k is not None and k[0] == "derived":  # programs stay outside scans
      walk.other(k, "an operand of scan (a value computed from parameters)")
      continue
    if k is None or k[0] not in _PARAM_KINDS:
      continue
    if k[0] != "param" or carry or over_batch or entering.count(k[1]) > 1:
      what = (
        "an operand of a scan over the batch"
        if over_batch
        else ("a scan carry" if carry else "an operand of scan")
      )
      walk.other(k, what)
      continue
    mode_of[k[1]] = "const" if j < num_consts else "xs"
    inner_env[v] = ("param", k[1])
  before = {leaf: len(walk.uses[leaf]) for leaf in mode_of}
  num_sites = len(walk.plan.sites)
  walk.loop_scopes[here] = (params["length"], mode_of)
  walk.loop_depth += 1
  out_kinds = _scan(body, inner_env, here, walk)
  walk.loop_depth -= 1
  for leaf, mode in mode_of.items():
    for u in range(before[leaf], len(walk.uses[leaf])):
      walk.modes[leaf, u] = (mode,) + walk.modes.get((leaf, u), ())
  inner = list(range(num_sites, len(walk.plan.sites)))
  if inner:
    walk.plan.loops[here] = inner
    for s in inner:
      lengths = walk.plan.site_loops.get(s, ())
      walk.plan.site_loops[s] = (params["length"],) + lengths
  for j, (v, k) in enumerate(zip(eqn.outvars, out_kinds)):
    if k is not None and k[0] == "derived" and (j < num_carry or counts.get(v)):
      # computed in the body, then used by later iterations or outside
      walk.other(k, "an output of a scan body (a value computed from it)")
    if k is None or k[0] not in _PARAM_KINDS:
      continue
    if j >= num_carry and k[0] == "param" and mode_of.get(k[1]) == "xs":
      env[v] = k  # the stacked leaf returned as is (NNX returns its state)
    elif counts.get(v, 0):
      walk.other(k, "an output of a scan body")


def _match(
  eqn, kinds: list, env: dict, here: tuple[int, ...], walk: _Walk, counts
) -> bool:
  """Records the cast, view, layer or bias an equation forms; False if none."""
  name = eqn.primitive.name
  first = kinds[0]
  if name in _PASS_THROUGH:
    ok = (
      len(kinds) == 1
      and first is not None
      and (
        first[0] in _PARAM_KINDS
        or (first[0] == "site" and counts[eqn.invars[0]] == 1)
      )
    )
    if ok:
      env[eqn.outvars[0]] = first
    return ok
  if name == "dot_general":
    return _match_dense(eqn, kinds, env, here, walk, counts)
  if (
    name == "transpose" and first is not None and first[0] in ("param", "perm")
  ):
    # A transposed leaf (a tied head ``x @ table.T``): a kernel only.
    perm = tuple(eqn.params["permutation"])
    if first[0] == "perm":
      perm = tuple(first[2][i] for i in perm)
    env[eqn.outvars[0]] = ("perm", first[1], perm)
    return True
  if name == "gather":
    return _match_embed(eqn, kinds, here, walk)
  if name == "conv_general_dilated":
    return _match_conv(eqn, kinds, here, walk)
  if name in ("reshape", "broadcast_in_dim") and len(kinds) == 1:
    view = _view_of(eqn, first)
    if view is not None:
      env[eqn.outvars[0]] = view
    return view is not None
  if name == "mul" and len(kinds) == 2:
    scaled = _scaled_param(eqn, kinds, here, walk)
    if scaled is not None:
      env[eqn.outvars[0]] = scaled
      return True
  if name in ("add", "mul") and len(kinds) == 2:
    return (name == "add" and _match_bias_add(eqn, kinds, walk)) or (
      _match_elementwise(eqn, kinds, here, walk)
    )
  return False


def _derived_operand(eqn, j: int, kind, here, walk: _Walk, what: str):
  """``(ok, program)`` of a layer's parameter-side operand ``j`` used as a
  derived value (``kind`` derived, or a view the layer rule cannot fold):
  not ``ok`` (an opaque use, recorded) inside nested scans, under
  ``shard_map``, in a scan from leaves the scan slices and leaves it
  shares, or when part of the value was computed inside a call that also
  takes inputs."""
  if walk.loop_depth > 1:
    walk.other(kind, f"{what}, computed from parameters inside nested scans")
    return False, None
  if walk.manual:
    walk.other(
      kind,
      f"{what}, computed from device-invariant parameters under shard_map "
      "(the estimators' axis_name makes them vary per device)",
    )
    return False, None
  program = walk.program(eqn.invars[j], here[:-1])
  if isinstance(program, str):
    walk.other(kind, f"{what}, computed from parameters {program}")
    return False, None
  return True, program


def _match_dense(eqn, kinds, env, here, walk: _Walk, counts) -> bool:
  """``x . W``: a site whose product may be followed by a bias."""
  for act in (0, 1):
    x_kind, w_kind = kinds[act], kinds[1 - act]
    if (x_kind is not None and x_kind[0] != "site") or (
      w_kind is None or w_kind[0] not in ("param", "perm", "scaled", "derived")
    ):
      continue
    ok, factor = _factor(w_kind, here, kernel=True)
    layout = _dense_layout(eqn, act, walk.batch)
    kind = "dense"
    if layout is None:  # per-head kernels: per-example gradients, chunked
      layout, kind = _batched_layout(eqn, act, walk.batch), "bdense"
    if layout is None:
      return False
    what = "the kernel of a dot_general"
    if kind == "bdense":
      what += " with batch axes"
    derived = None
    if not ok or w_kind[0] == "derived":  # a mask, WeightNorm, ...
      ok, derived = _derived_operand(eqn, 1 - act, w_kind, here, walk, what)
      if not ok:
        return True
      factor = None
    if w_kind[0] == "perm":  # kernel axis i is the leaf's axis perm[i]
      layout["leaf_perm"] = tuple(w_kind[2][i] for i in layout["leaf_perm"])
    site = _Site(
      kind,
      here,
      -1 if derived is not None else w_kind[1],
      act_index=act,
      factor=factor,
      derived=derived,
      direct=w_kind[0] == "param",
      **layout,
    )
    index = walk.add_site(site, "kernel", what)
    if counts[eqn.outvars[0]] == 1 and kind == "dense":
      env[eqn.outvars[0]] = ("site", index)
    return True
  return False


def _match_conv(eqn, kinds, here, walk: _Walk) -> bool:
  """``conv(x, W)``: a convolution of an activation with a parameter kernel.

  ``x`` (the lhs) carries the examples on axis 0, as does the output; any
  kernel layout, strides, padding, dilations and feature groups. The
  output is tapped; per-example kernel gradients contract the input
  patches with ``delta`` (:func:`_conv_kernel_grads`).
  """
  x_k, w_k = kinds[0], kinds[1]
  if (
    w_k is None
    or w_k[0] not in ("param", "scaled", "derived")
    or (x_k is not None and x_k[0] != "site")
  ):
    return False
  params = eqn.params
  dn = params["dimension_numbers"]
  x, out = eqn.invars[0].aval, eqn.outvars[0].aval
  what = "the kernel of a conv_general_dilated"
  if params.get("batch_group_count", 1) != 1:
    walk.other(w_k, f"{what} with batch_group_count > 1")
    return True
  if (
    dn.lhs_spec[0] != 0
    or dn.out_spec[0] != 0
    or x.shape[:1] != (walk.batch,)
    or out.shape[:1] != (walk.batch,)
  ):
    walk.other(w_k, f"{what} whose input has no example axis 0")
    return True
  ok, factor = _factor(w_k, here, kernel=True)
  derived = None
  if not ok or w_k[0] == "derived":  # weight standardisation, a mask, ...
    ok, derived = _derived_operand(eqn, 1, w_k, here, walk, what)
    if not ok:
      return True
    factor = None
  kernel = -1 if derived is not None else w_k[1]
  site = _Site(
    "conv",
    here,
    kernel,
    eqn=eqn,
    factor=factor,
    derived=derived,
    direct=w_k[0] == "param",
  )
  walk.add_site(site, "kernel", what)
  return True


def _match_embed(eqn, kinds, here, walk: _Walk) -> bool:
  """``table[ids]``: a row gather of a parameter table."""
  table, ids = kinds[0], kinds[1]
  if (
    table is None
    or ids is not None
    or table[0] != "param"
    or not _is_embed(eqn, walk.batch)
  ):
    return False
  site = _Site(
    "embed",
    here,
    table[1],
    act_index=1,
    mode=eqn.params["mode"],
    num_rows=eqn.invars[0].aval.shape[0],
  )
  walk.add_site(site, "table", "an embedding table (row gather)")
  return True


def _match_bias_add(eqn, kinds, walk: _Walk) -> bool:
  """``site + bias view``: the site's bias, if it has none yet.

  The bias spans exactly the kernel's output axes (the trailing axes of
  the product), broadcast over the example and position axes.
  """
  for j in (0, 1):
    site_k, bias_k = kinds[j], kinds[1 - j]
    if (
      site_k is None
      or site_k[0] != "site"
      or bias_k is None
      or bias_k[0] != "view"
    ):
      continue
    site = walk.plan.sites[site_k[1]]
    shape = tuple(eqn.invars[j].aval.shape)
    lead = len(shape) - site.num_free
    if (
      site.kind != "dense"
      or site.act_index != 0
      or site.bias is not None
      or site.num_free < 1
      or bias_k[2] != (1,) * lead + shape[lead:]
      or tuple(eqn.outvars[0].aval.shape) != shape
    ):
      continue
    site.bias = bias_k[1]
    walk.uses[bias_k[1]].append(("bias", site_k[1], "the bias of a product"))
    return True
  return False


def _match_elementwise(eqn, kinds, here, walk: _Walk) -> bool:
  """``x * p`` or ``x + p``: an elementwise scale or shift parameter.

  ``p`` is a leaf broadcast along the example axis (and any others) to the
  output, ``x`` anything but a parameter; the output is tapped and the
  example gradient is ``delta`` (shift) or ``x * delta`` (scale) summed over
  the broadcast axes.
  """
  out = eqn.outvars[0].aval
  kind = "shift" if eqn.primitive.name == "add" else "scale"
  for j in (0, 1):
    p_k, x_k = kinds[j], kinds[1 - j]
    if p_k is None or p_k[0] not in ("param", "view", "scaled", "derived"):
      continue
    if x_k is not None and x_k[0] != "site":
      return False
    ok, factor = _factor(p_k, here)
    # A derived value (softplus(p), exp(p)) and a view that cannot fold
    # into the activation (a shift times a constant) run as programs.
    derive = p_k[0] == "derived" or not ok or (factor and kind == "shift")
    if derive or p_k[0] == "param":
      compact = tuple(eqn.invars[j].aval.shape)
    else:
      compact = p_k[2]
    if not compact:  # a scalar parameter broadcasts along every axis
      compact = (1,) * len(out.shape)
    if (
      len(out.shape) < 1
      or out.shape[0] != walk.batch
      or len(compact) != len(out.shape)
      or compact[0] != 1
      or any(c not in (1, o) for c, o in zip(compact, out.shape))
    ):
      return False
    what = f"an elementwise {kind} ({eqn.primitive.name})"
    derived = None
    if derive:
      ok, derived = _derived_operand(eqn, j, p_k, here, walk, what)
      if not ok:
        return True
      factor = None
    leaf = -1 if derived is not None else p_k[1]
    site = _Site(
      kind,
      here,
      leaf,
      act_index=1 - j,
      compact=compact,
      factor=factor,
      derived=derived,
    )
    if factor is not None:
      what += " of the parameter times a constant"
    walk.add_site(site, "bias", what)
    return True
  return False


def _make_plan(closed, num_leaves: int, batch: int) -> _Plan:
  plan = _Plan(sites=[], roles=[None] * num_leaves, site_at={}, inline=set())
  uses: list[list[tuple[str, int, str]]] = [[] for _ in range(num_leaves)]
  # A zero-size leaf is no site (its views would have zero-size axes to
  # infer); the per-example path gives its empty statistics, which XLA
  # computes from nothing.
  env = {
    v: ("param", i)
    for i, v in enumerate(closed.jaxpr.invars[:num_leaves])
    if math.prod(v.aval.shape)
  }
  walk = _Walk(batch, plan, uses)
  manual = {
    a
    for v in closed.jaxpr.invars[num_leaves:]
    for a in numerics.varying_axes(v.aval)
  }
  walk.manual = any(
    not manual <= set(numerics.varying_axes(v.aval))
    for v in closed.jaxpr.invars[:num_leaves]
  )
  out_kinds = _scan(closed.jaxpr, env, (), walk)
  for k in out_kinds:  # a leaf returned as an output is an opaque use
    walk.other(k, "returned by apply_fn")
  for leaf, u in enumerate(uses):
    modes = [walk.modes.get((leaf, k), ()) for k in range(len(u))]
    reason = _reason(u, modes)
    if not u:
      plan.unused.add(leaf)
    if not math.prod(closed.jaxpr.invars[leaf].aval.shape):
      reason = "a zero-size leaf (an empty statistic)"
      plan.unused.add(leaf)
    if u and all(role != "other" for role, _, _ in u):
      conv = any(plan.sites[site].kind in _CHUNKED for _, site, _ in u)
      plan.roles[leaf] = (u[0][1], u[0][0])
      # A conv kernel's statistics always come from chunked per-example
      # gradients (LayerGrads._use_grads; no cheap (a, delta) form for them),
      # as do a derived value's (a VJP per example).
      derived = any(role == "derived" for role, _, _ in u)
      if len(u) > 1 or "xs" in modes[0] or conv or derived:
        plan.special[leaf] = [
          (site, role, m) for (role, site, _), m in zip(u, modes)
        ]
    plan.reasons.append(reason)
  # A bias whose product is not tapped for its kernel still needs the tap;
  # every site is tapped, uncovered ones simply go unused.
  return plan


def _stacked_only(modes: Sequence[str]) -> bool:
  """Whether every scan around a use slices its leaf (``"xs"``): a stack
  of layers, not a leaf shared by iterations (true outside scans)."""
  return all(m == "xs" for m in modes)


def _reason(
  uses: list[tuple[str, int, str]], modes: Sequence[tuple[str, ...]]
) -> str:
  """Why a leaf is (not) on the layer path, from its recorded uses."""
  if not uses:
    return "not used by apply_fn"

  def where(what: str, m: tuple[str, ...]) -> str:
    if "xs" in m:
      return f"{what}, stacked along the iterations of a scan"
    return f"{what}, shared by the iterations of a scan" if m else what

  if len(uses) == 1:
    role, _, what = uses[0]
    if role == "other":
      return f"{what}: no layer rule matches"
    return where(what, modes[0])
  whats = "; ".join(sorted({where(w, m) for (_, _, w), m in zip(uses, modes)}))
  others = [w for role, _, w in uses if role == "other"]
  if others:
    return (
      f"used {len(uses)} times ({whats}): {others[0]}: no layer rule matches"
    )
  return (
    f"shared by {len(uses)} uses ({whats}): per-example gradients summed "
    "over the uses"
  )


# --------------------------------------------------------------------------
# Evaluating the jaxpr with taps.


def _bind(eqn, invals):
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
    subfuns, bind_params = bind_params
    invals = [*subfuns, *invals]
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  if ctx is None:
    out = eqn.primitive.bind(*invals, **bind_params)
  else:
    with ctx:
      out = eqn.primitive.bind(*invals, **bind_params)
  return out if eqn.primitive.multiple_results else [out]


def _bind_conv(eqn, invals):
  """A convolution outside loops, its kernel stored with the feature axes
  exchanged (on XLA:CPU; elsewhere as it is).

  XLA:CPU rewrites convolutions into the layout of its fast kernels in the
  entry computation only. The input-cotangent convolution autodiff makes
  (kernel reversed, feature axes exchanged) runs inside the loops that
  pull samples back one per pass, and there, in the layout JAX gives it,
  it fell back to a generic emitter 3.5x slower: half of a CNN's exact
  diagonal. With the kernel stored transposed (behind a barrier, so XLA
  cannot fold the transpose into the convolution again) that convolution
  has the fast layout; the forward one is rewritten as usual.
  """
  if not _xla_cpu():
    return _bind(eqn, invals)
  x, k = invals
  dn = eqn.params["dimension_numbers"]
  out_dim, in_dim = dn.rhs_spec[:2]
  perm = list(range(np.ndim(k)))
  perm[out_dim], perm[in_dim] = in_dim, out_dim
  k = lax.optimization_barrier(jnp.transpose(k, perm))
  spec = (in_dim, out_dim) + tuple(dn.rhs_spec[2:])
  params = dict(eqn.params, dimension_numbers=dn._replace(rhs_spec=spec))
  return _bind(eqn.replace(params=params), [x, k])


def _bind_loop_conv(eqn, invals):
  """A conv site inside a loop, on XLA:CPU with its kernel's cotangent
  summed from input patches and output cotangents, a chunk of examples at a
  time (a matmul; elsewhere as it is).

  XLA:CPU runs the kernel-gradient convolution autodiff makes inside a
  loop's body with its generic emitter (as :func:`_bind_conv` says of the
  input-cotangent one): on the benchmark CNN with two stacked 3x3 convs it
  was about three quarters of a whole batch gradient. Input and kernel in
  the equation's layouts, examples leading."""
  dn = eqn.params["dimension_numbers"]
  plain = dn.lhs_spec[0] != 0 or dn.out_spec[0] != 0
  if not _xla_cpu() or plain or eqn.params["batch_group_count"] != 1:
    return _bind(eqn, invals)

  def kernel_cotangent(x, dz):  # no statistic
    dtype = jnp.promote_types(jnp.promote_types(x.dtype, dz.dtype), "float32")
    dw = _sum_over_example_chunks(
      lambda xc, dc: jnp.sum(_conv_kernel_grads(eqn, xc, dc), axis=0),
      [x, dz],
      [0, 0],
      x.shape[0],
      _patch_chunk(eqn, None),
      eqn.invars[1].aval.shape,
      dtype,
    )
    return {}, dw

  layer = _ordered_layer(kernel_cotangent, functools.partial(_bind, eqn), 0)
  return [layer(*invals, invals[0], {})]


# Remat primitives: their bodies are re-run under ``jax.checkpoint`` with
# the same policy, so a tapped body is still recomputed in the backward pass.
_REMATS = ("checkpoint", "remat", "remat2")


def _eval(
  jaxpr,
  consts,
  args,
  path,
  plan: _Plan,
  taps,
  acts: dict,
  fused: dict | None = None,
  top: bool = True,
) -> list:
  """Evaluates ``jaxpr`` with a tap added to every site's output.

  A site in ``fused`` (site -> :class:`_FusedSite`) returns its output
  through its tap function, whose cotangent for the tap is the statistic,
  and records its ``forward`` statistic (if any) in ``acts``; the others
  record their activation there. ``top``: outside loops and ``remat``
  bodies (see :func:`_bind_conv`).
  """
  fused = fused or {}
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jex.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for i, eqn in enumerate(jaxpr.eqns):
    here = path + (i,)
    invals = [read(v) for v in eqn.invars]
    if here in plan.inline:
      outs = _eval_call(eqn, invals, here, plan, taps, acts, fused, top)
    elif here in plan.loops:
      outs = _eval_loop(eqn, invals, here, plan, taps, acts, fused)
    else:
      site = plan.site_at.get(here)
      conv = eqn.primitive is lax.conv_general_dilated_p
      if conv and top:
        bind = functools.partial(_bind_conv, eqn)
      elif conv and site in plan.site_loops and plan.sites[site].act_index == 0:
        bind = functools.partial(_bind_loop_conv, eqn)
      else:
        bind = functools.partial(_bind, eqn)
      f = fused.get(site) if site is not None else None
      if site is None:
        outs = bind(invals)
      elif f is not None and f.ordered is not None:
        # Its equation under _ordered_layer.
        act = _site_act(plan.sites[site], invals, read)
        layer = _ordered_layer(f.ordered, bind, plan.sites[site].act_index)
        outs = [layer(*invals, act, taps[site])]
      elif f is not None:
        # The tap's backward returns no cotangent for act; read through a
        # stop_gradient, a scan would keep it as a second stacked residual.
        outs = bind(invals)
        act = _site_act(plan.sites[site], invals, read)
        if f.forward is not None:
          acts[site] = f.forward(act, lax.stop_gradient(outs[0]))
        outs = [f.tap(outs[0], act if f.needs_act else None, taps[site])]
      else:
        outs = bind(invals)
        acts[site] = _site_act(plan.sites[site], invals, read)
        outs = [outs[0] + taps[site]]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jex.DropVar):
        env[v] = x
    for d, k in plan.capture.get(here, ()):  # a derived value's inputs
      v = plan.derived[d].inputs[k][1]
      acts["derived", d, k] = lax.stop_gradient(read(v))
  return [read(v) for v in jaxpr.outvars]


def _site_act(site: _Site, invals: list, read: Callable[[Any], Any]) -> Array:
  """The activation a site records: its operand ``x``, times the constant
  its parameter enters with (``x * (c * p) = (x * c) * p``)."""
  x = invals[site.act_index]
  if site.factor is None:
    return x
  var, shape = site.factor
  c = jnp.asarray(read(var))
  if c.size == 1:  # a scalar, or size-one axes
    c = jnp.reshape(c, ())
  else:  # the leaf's constant, laid out as the leaf's view
    c = jnp.reshape(jnp.broadcast_to(c, shape), site.compact)
  return (x * c).astype(x.dtype)


def _eval_call(
  eqn, invals, here, plan: _Plan, taps, acts: dict, fused, top: bool
):
  """Inlines a call holding sites; a remat body stays under ``checkpoint``
  (its recorded activations are its extra outputs)."""
  inner, inner_consts = _call_body(eqn)
  if eqn.primitive.name not in _REMATS:
    return _eval(
      inner, inner_consts, invals, here, plan, taps, acts, fused, top
    )

  keys: list = []  # sites and derived inputs (mixed keys: not a pytree)

  def body(args, taps):
    inner_acts: dict = {}
    outs = _eval(
      inner, inner_consts, args, here, plan, taps, inner_acts, fused, False
    )
    keys[:] = inner_acts
    return outs, list(inner_acts.values())

  remat = jax.checkpoint(
    body,
    prevent_cse=eqn.params.get("prevent_cse", True),
    policy=eqn.params.get("policy"),
  )
  outs, values = remat(list(invals), taps)
  acts.update(zip(keys, values))
  return outs


def _eval_loop(
  eqn, invals, here, plan: _Plan, taps, acts: dict, fused: dict
) -> list:
  """Re-runs a ``scan`` whose body holds sites: their taps enter as extra
  ``xs`` and the activations of the unfused ones (the forward statistics
  of fused ones) leave as extra ``ys`` (a leading iteration axis, aligned
  with ``xs`` also when ``reverse``)."""
  params = eqn.params
  num_consts, num_carry = params["num_consts"], params["num_carry"]
  body = params["jaxpr"]
  consts = invals[:num_consts]
  init = invals[num_consts : num_consts + num_carry]
  inner = plan.loops[here]
  recorded = [s for s in inner if s not in fused or fused[s].forward]
  captured = [  # the inputs of derived values in the body, per iteration
    ("derived", d, k)
    for path, reads in plan.capture.items()
    if len(path) > len(here) and path[: len(here)] == here
    for d, k in reads
  ]

  # A shared tap (the Gram's) enters every iteration whole: the backward
  # pass then sums its cotangent in the loop's carry.
  shared = {s: taps[s] for s in inner if s in fused and fused[s].shared}
  sliced = [s for s in inner if s not in shared]

  def step(carry, x):
    xs, inner_taps = x
    inner_acts: dict = {}
    outs = _eval(
      body.jaxpr,
      body.consts,
      [*consts, *carry, *xs],
      here,
      plan,
      {**dict(zip(sliced, inner_taps)), **shared},
      inner_acts,
      fused,
      False,
    )
    ys = (
      outs[num_carry:],
      tuple(inner_acts[s] for s in recorded),
      tuple(inner_acts[c] for c in captured),
    )
    return outs[:num_carry], ys

  carry, (ys, inner_acts, inputs) = lax.scan(
    step,
    list(init),
    (list(invals[num_consts + num_carry :]), tuple(taps[s] for s in sliced)),
    length=params["length"],
    reverse=params["reverse"],
    unroll=params["unroll"],
  )
  acts.update(zip(recorded, inner_acts))
  acts.update(  # a shared value's inputs: any iteration's (the first)
    (c, x[0] if plan.derived[c[1]].first else x)
    for c, x in zip(captured, inputs)
  )
  return [*carry, *ys]


def check_apply_outputs(out: Any, size: int) -> None:
  """Raises unless ``out`` (an array, or its abstract value) is one array
  with the batch axis first."""
  shape = getattr(out, "shape", None)
  if isinstance(out, (tuple, list, dict)) or not shape or shape[0] != size:
    got = type(out).__name__ if shape is None else tuple(shape)
    raise ValueError(
      "apply_fn(params, inputs) must return one array with the batch "
      f"axis first, shape ({size}, ...); got {got}."
    )


def _trace(apply_fn, params, inputs):
  """make_jaxpr of apply_fn on flat (param leaves, input leaves)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  in_leaves, in_def = jax.tree_util.tree_flatten(inputs)
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(
        f"params leaf {jax.tree_util.keystr(path)} is not an array: "
        f"{type(x).__name__}."
      )
  validation.check_real_floating(
    params, what="params", function="every Fisher estimator"
  )
  batches = {int(np.shape(x)[0]) for x in in_leaves if np.ndim(x) > 0}
  if len(batches) != 1 or any(np.ndim(x) == 0 for x in in_leaves):
    raise ValueError(
      "inputs must be a non-empty pytree of arrays sharing one leading "
      f"batch axis; got leading sizes {sorted(batches)}."
    )
  num = len(leaves)

  def flat_apply(*flat):
    p = jax.tree_util.tree_unflatten(treedef, flat[:num])
    x = jax.tree_util.tree_unflatten(in_def, flat[num:])
    return apply_fn(p, x)

  closed, out_shape = jax.make_jaxpr(flat_apply, return_shape=True)(
    *leaves, *in_leaves
  )
  out_def = jax.tree_util.tree_structure(out_shape)
  return leaves, treedef, in_leaves, closed, out_def, batches.pop()


# --------------------------------------------------------------------------
# Public: recording a forward pass and pulling cotangents back to the taps.


@dataclasses.dataclass
class LayerTape:
  """A traced forward pass with zero taps on every matched layer.

  Built by :func:`record`. ``covered`` is a params-shaped tree of Python bools
  (static), ``outputs`` the model outputs of the recorded forward pass.
  """

  _plan: _Plan
  _treedef: Any
  _leaves: list[Any]
  _covered: list[bool]
  outputs: PyTree
  _pullback: Callable[..., Any]
  _acts: tuple[Any, ...]
  batch: int
  _fusion: _Fusion | None = None
  _derived: tuple[Any, ...] = ()  # the inputs of each derived program

  @property
  def covered(self) -> PyTree:
    return jax.tree_util.tree_unflatten(self._treedef, self._covered)

  @property
  def fused(self) -> bool:
    """Whether some leaves' statistic forms inside the backward pass
    (:func:`record`'s ``statistic``), their activations not kept: the tape
    then serves only that statistic. (Leaves whose per-example gradients
    form there, ``ordered`` with ``"gram"``, also serve
    :meth:`LayerGrads.combine`.)"""
    return self._fusion is not None and bool(self._fusion.statistic_leaves)

  @property
  def unused(self) -> PyTree:
    """Params-shaped bools: leaves ``apply_fn`` never reads (or zero-size),
    whose statistics are zero on any path."""
    leaves = [i in self._plan.unused for i in range(len(self._covered))]
    return jax.tree_util.tree_unflatten(self._treedef, leaves)

  def covered_for(self, structure: str) -> PyTree:
    """Like ``covered``, for the leaves ``statistics(structure)`` fills.

    ``"kron"`` leaves out covered leaves whose K-FAC factors do not fit
    their matrix view (:class:`LeafCoverage` ``kronecker``).
    """
    if structure != "kron":
      return self.covered
    cov = _leaf_coverage(self._plan, self._leaves)
    return jax.tree_util.tree_unflatten(
      self._treedef, [c.kronecker for c in cov]
    )

  def _prepare(self, cotangents: PyTree, lead: int) -> tuple[PyTree, int]:
    """Checks cotangents against the outputs and casts them to their dtype."""
    out_leaves, out_def = jax.tree_util.tree_flatten(self.outputs)
    ct_leaves, ct_def = jax.tree_util.tree_flatten(cotangents)
    if ct_def != out_def:
      raise ValueError(
        "cotangents must have the structure of the model outputs "
        f"{out_def}, got {ct_def}."
      )
    num = 1
    for i, (o, c) in enumerate(zip(out_leaves, ct_leaves)):
      if (
        not hasattr(c, "shape")
        or c.ndim != o.ndim + lead
        or tuple(c.shape[lead:]) != tuple(o.shape)
      ):
        want = ("(S, " if lead else "(") + ", ".join(map(str, o.shape)) + ")"
        raise ValueError(
          f"cotangents must have shape {want} to match the outputs; got "
          f"{getattr(c, 'shape', type(c).__name__)}."
        )
      if lead:
        if i and c.shape[0] != num:
          raise ValueError("cotangent leaves disagree on the sample axis S.")
        num = c.shape[0]
    ct_leaves = [c.astype(o.dtype) for o, c in zip(out_leaves, ct_leaves)]
    return jax.tree_util.tree_unflatten(ct_def, ct_leaves), num

  def backward(
    self,
    cotangents: PyTree,
    *,
    columns: Callable[[Array, int], PyTree] | None = None,
  ) -> LayerGrads:
    """Pulls ``S`` output cotangents back to the taps.

    The backward pass runs when a statistic first needs it: a few samples
    per pass for the diagonal and the K-FAC sums (see
    :meth:`LayerGrads.statistics`' ``chunk_size``), one vmapped pass for all
    ``S`` otherwise.

    Args:
      cotangents: like ``outputs`` with an extra leading axis ``S``.
      columns: ``(start, n) -> cotangents[start : start + n]`` (zero past
        ``S``), which the passes that take a few samples at a time call
        instead of slicing ``cotangents``: then ``cotangents`` need never
        be formed whole (the exact kind's ``S`` can be ``T * C`` for
        sequence outputs).

    Returns:
      A :class:`LayerGrads` of the per-example ``delta`` of every layer.
    """
    cts, num = self._prepare(cotangents, 1)
    fusion = self._fusion
    if fusion is not None and fusion.statistic in ("gram", "combine"):
      if num != 1:
        raise ValueError(
          f"a tape recorded with statistic={fusion.statistic!r} pulls back "
          f"one sample (S = 1); got S = {num}. Record with statistic=None "
          "for several samples."
        )
    if fusion is not None and fusion.weights is not None:
      # As the forward pass (record): XLA would start this backward pass
      # from cotangents made early, before the pass that makes the weights.
      cts = jax.tree.map(lambda c: _after(c, fusion.weights), cts)
    # Pulled back when first needed: the diagonal sums go through the
    # samples a few at a time instead (LayerGrads.statistics).
    if columns is not None:
      source = columns
      columns = lambda start, n: self._prepare(source(start, n), 1)[0]
    return LayerGrads(self, None, num, cotangents=cts, columns=columns)

  def _pull(self, cts: PyTree) -> tuple:
    """The taps' ``delta`` of ``S`` cotangents, one vmapped backward. Only
    the tap cotangents are kept: under jit XLA drops the unused
    weight-gradient products."""
    return tuple(jax.vmap(lambda c: self._pullback(c)[1])(cts))

  def gradient(self, cotangent: PyTree) -> tuple[PyTree, LayerGrads]:
    """One backward pass for ``sum_n J_n^T r_n`` and the layer ``delta``.

    The training step's gradient and, for ``kind="empirical"``, the Fisher
    statistics then come from a single forward and a single backward pass.

    Args:
      cotangent: like ``outputs`` (no sample axis).

    Returns:
      ``(grad, layer_grads)``: ``grad`` params-shaped (the summed, not
      averaged, gradient), ``layer_grads`` a :class:`LayerGrads` with
      ``S = 1``.
    """
    cot, _ = self._prepare(cotangent, 0)
    leaf_cts, deltas = self._pullback(cot)
    grad = jax.tree_util.tree_unflatten(self._treedef, list(leaf_cts))
    deltas = jax.tree.map(lambda d: d[None], tuple(deltas))
    return grad, LayerGrads(self, deltas, 1)


def _site_avals(plan: _Plan, closed) -> tuple[dict, dict]:
  """Per site: ``(lead, output aval)`` (``lead`` the lengths of the scans
  around it, a tap per iteration) and the activation's aval."""
  out_shapes, act_avals = {}, {}

  def collect(jaxpr, path, lead=()):
    for i, eqn in enumerate(jaxpr.eqns):
      here = path + (i,)
      if here in plan.site_at:
        s = plan.site_at[here]
        out_shapes[s] = (lead, eqn.outvars[0].aval)
        act_avals[s] = eqn.invars[plan.sites[s].act_index].aval
      if here in plan.inline:
        collect(_call_body(eqn)[0], here, lead)
      elif here in plan.loops:
        length = (eqn.params["length"],)
        collect(eqn.params["jaxpr"].jaxpr, here, lead + length)

  collect(closed.jaxpr, ())
  return out_shapes, act_avals


def held_elements(
  apply_fn: Callable[[PyTree, PyTree], PyTree],
  params: PyTree,
  inputs: PyTree,
  *,
  statistic: str | None = None,
) -> tuple[int, int]:
  """``(elements, B)``: what a :func:`record` tape's backward pass holds per
  sample, the activations and output cotangents of its recorded layers
  (those ``statistic`` does not form inside the pass), from a trace only.

  A proxy for the forward residuals a pass of one sample keeps alive: the
  estimators split the examples into chunks when it exceeds a budget.
  """
  leaves, _, _, closed, _, batch = _trace(apply_fn, params, inputs)
  plan = _make_plan(closed, len(leaves), batch)
  out_shapes, act_avals = _site_avals(plan, closed)
  fused = _by_site(_fusable(plan, statistic)) if statistic is not None else {}
  total = 0
  for s, (lead, out) in out_shapes.items():
    if s in fused:
      continue
    act = 0 if plan.sites[s].kind == "shift" else math.prod(act_avals[s].shape)
    total += math.prod(lead) * (act + math.prod(out.shape))
  return total, batch


def record(
  apply_fn: Callable[[PyTree, PyTree], PyTree],
  params: PyTree,
  inputs: PyTree,
  *,
  axis_name: str | None = None,
  statistic: str | None = None,
  chunk_size: int | None = None,
  weight_sharing: str = "expand",
  weights: Array | None = None,
  ordered: bool = False,
) -> LayerTape:
  """Runs ``apply_fn(params, inputs)`` with zero taps on its dense layers.

  Args:
    apply_fn: ``apply_fn(params, inputs) -> outputs`` with a leading batch axis
      on ``inputs`` and ``outputs``.
    params: the parameters (any pytree of arrays).
    inputs: the batch inputs (any pytree of arrays with leading axis ``B``).
    axis_name: inside ``shard_map``, the batch axis name. Optional: taps are
      made device-varying like their layer outputs automatically, so autodiff
      never sums tap cotangents (examples) across devices.
    statistic: ``"diag"``, ``"kron"``, ``"gram"`` or ``"combine"`` to
      form that statistic of the leaves stacked along a scan (one use each,
      a dense, scale, shift, conv or per-head layer) inside the
      backward pass, one iteration at a time: the pass then keeps neither
      their activations nor their cotangents ``(L, B, T, ...)``, and a
      ``remat`` body is still recomputed, so memory stays near the batch
      gradient's.
      :meth:`LayerGrads.statistics` (or, for ``"combine"``,
      :meth:`LayerGrads.combine` with ``weights``) then serves only that
      structure (and ``weight_sharing``) for them. ``"gram"`` and
      ``"combine"`` need one sample (``S = 1``) per backward pass: a sum
      over pairs of examples, or over weighted examples, cannot be split
      by sample. Where they fuse stacked leaves they also fuse the dense,
      scale, shift, conv and per-head layers used once outside scans (low
      rank then runs two passes anyway), and every fused layer adds its
      Gram matrix to one ``(B, B)`` sum in the backward pass. ``None``
      (default) records every layer's ``(a, delta)``.
    chunk_size: with ``statistic="diag"`` or ``"gram"``, as in
      :meth:`LayerGrads.statistics`.
    weight_sharing: with ``statistic="kron"``, as in
      :meth:`LayerGrads.statistics`.
    weights: with ``statistic="combine"``, the ``(k, B)`` weights of
      :meth:`LayerGrads.combine`: a low-rank Fisher's directions from a
      first pass's Gram matrix.
    ordered: with ``statistic="diag"``, also form the diagonal of conv
      layers, dense layers shared over positions, and dense layers whose
      input is larger than the statistics' chunk budget, outside scans,
      inside the backward pass, and pull back each such layer's input
      cotangent after its statistic and its parameter's cotangent, which
      both read the layer's input: the input is freed before the next
      cotangent is written, as in the gradient alone, not held next to it
      for a statistic formed after. A conv (stacked along a scan too) or
      shared dense kernel's cotangent is then the sum of the per-example
      gradients its diagonal forms (no kernel-gradient product). With
      ``statistic="gram"``, where every stacked leaf qualifies, the
      backward pass instead forms the per-example gradients ``(B, *leaf)``
      of the conv, dense, scale and shift layers (outside scans or stacked
      along them, one use each) whose gradients have fewer elements than
      the layer's input and output cotangent (convs, norms, biases over
      positions): the tape keeps those in place of the layer's ``(a,
      delta)``, they give both the Gram matrix and
      :meth:`LayerGrads.combine` (one pass, not two), and a conv or dense
      kernel's cotangent is their sum. For one backward pass (the
      empirical Fisher's); a loop of passes would form the statistic in
      every one.

  Returns:
    A :class:`LayerTape`; call ``.backward(cotangents)`` on it.
  """
  if statistic is not None:
    validation.check_choice("statistic", statistic, FUSED_STATISTICS)
  validation.check_choice("weight_sharing", weight_sharing, WEIGHT_SHARING)
  if (statistic == "combine") != (weights is not None):
    raise ValueError(
      "record takes weights= exactly with statistic='combine'; got "
      f"statistic={statistic!r} and weights "
      f"{'given' if weights is not None else 'None'}."
    )
  leaves, treedef, in_leaves, closed, out_def, batch = _trace(
    apply_fn, params, inputs
  )
  check_independent_examples(closed, len(leaves), batch)
  if weights is not None:
    weights = jnp.asarray(weights)
    if weights.ndim != 2 or weights.shape[1] != batch:
      raise ValueError(
        f"weights must have shape (k, B) = (k, {batch}); got "
        f"{tuple(weights.shape)}."
      )
  num = len(leaves)
  plan = _make_plan(closed, num, batch)
  covered = [r is not None for r in plan.roles]
  out_shapes, act_avals = _site_avals(plan, closed)
  orders = {
    s
    for s, aval in act_avals.items()
    if ordered and statistic == "diag" and _orders(plan.sites[s], aval, batch)
  }
  fused_leaves = (
    _fusable(plan, statistic, orders) if statistic is not None else {}
  )
  grads_leaves = {}
  if ordered and statistic == "gram":
    grads_leaves = _grads_fusable(plan, leaves, act_avals, out_shapes, batch)
    stacked = {
      k for k in fused_leaves if any(u[2] for u in plan.special.get(k, []))
    }
    if stacked <= set(grads_leaves):  # one pass: no Gram-only tap
      fused_leaves = {}
    else:
      grads_leaves = {}
  fused, stat_avals, gram_fns = {}, {}, {}
  for s, users in _by_site(fused_leaves).items():
    site, act = plan.sites[s], act_avals[s]
    lead = out_shapes[s][0]
    shapes = {
      leaf: tuple(np.shape(leaves[leaf]))[len(lead) :] for leaf in users
    }
    assert statistic is not None
    stat_fn = functools.partial(
      _fused_stat,
      site,
      [(leaf, role, shapes[leaf]) for leaf, role in users.items()],
      batch,
      statistic,
      chunk_size,
      weight_sharing == "reduce",
    )
    out = out_shapes[s][1]
    # K-FAC's A comes from the forward pass; a shift's statistic from delta.
    forward = None
    if statistic == "kron" and site.kind not in _ELEMENTWISE:
      forward = functools.partial(
        _fused_inputs,
        site,
        [(leaf, role, shapes[leaf]) for leaf, role in users.items()],
        batch,
        weight_sharing == "reduce",
      )
    needs_act = site.kind != "shift" and forward is None
    a = jax.ShapeDtypeStruct(act.shape, act.dtype) if needs_act else None
    delta = jax.ShapeDtypeStruct(out.shape, out.dtype)
    if statistic == "gram":  # the layer's leaves summed: one (B, B)
      gram_fns[s] = stat_fn
      stat_fn = functools.partial(_summed, stat_fn, None)
    if weights is None:
      stat_avals[s] = jax.eval_shape(stat_fn, a, delta)
    else:  # {leaf: (weights, sums)}: the weights' cotangent is zero
      tap = {leaf: (numerics.widen(weights), None) for leaf in users}
      stat_avals[s] = jax.eval_shape(stat_fn, a, delta, tap)
    fused[s] = _FusedSite(
      _fused_tap(stat_fn, reads_tap=weights is not None),
      needs_act,
      forward,
      None
      if statistic != "diag"
      # Stacked convs too: XLA:CPU ran a kernel-gradient convolution in a
      # scan's backward iterations about 4x slower than these sums.
      or (s in plan.site_loops and not (ordered and site.kind == "conv"))
      else functools.partial(  # an unscanned layer or a stacked conv
        _ordered_stat,
        site,
        [(leaf, role, shapes[leaf]) for leaf, role in users.items()],
        batch,
        chunk_size,
      ),
      shared=statistic == "gram",
    )
  for s, users in _by_site(grads_leaves).items():
    site, act = plan.sites[s], act_avals[s]
    lead = out_shapes[s][0]
    spec = [
      (leaf, role, tuple(np.shape(leaves[leaf]))[len(lead) :])
      for leaf, role in users.items()
    ]
    grads_fn = functools.partial(_grads_stat, site, spec, batch, chunk_size)
    needs_act = site.kind != "shift"
    a = jax.ShapeDtypeStruct(act.shape, act.dtype) if needs_act else None
    out = out_shapes[s][1]
    delta = jax.ShapeDtypeStruct(out.shape, out.dtype)
    stat_avals[s] = jax.eval_shape(grads_fn, a, delta)
    kernel = [leaf for leaf, role in users.items() if role == "kernel"]
    fused[s] = _FusedSite(
      _fused_tap(grads_fn),
      needs_act,
      # A kernel's cotangent is its gradients' sum (no kernel-gradient
      # product), its input's pulled back after them (_ordered_layer).
      ordered=functools.partial(_ordered_grads, grads_fn, kernel[0])
      if kernel and site.kind in ("conv", "dense") and site.direct
      else None,
    )
  # "gram": every fused site adds its (B, B) to one tap that no scan slices,
  # so the backward pass sums it in place (one Gram, not one per leaf and
  # iteration).
  gram = None
  if gram_fns:
    dtype = jnp.result_type(*(stat_avals[s].dtype for s in gram_fns))
    gram = jnp.zeros((batch, batch), dtype)
    vma = tuple(
      sorted(
        {a for s in gram_fns for a in numerics.varying_axes(out_shapes[s][1])}
      )
    )
    if axis_name is not None and axis_name not in vma:
      vma = vma + (axis_name,)
    if vma:
      gram = lax.pcast(gram, vma, to="varying")
    for s, fn in gram_fns.items():  # a cotangent takes its tap's dtype
      tap = _fused_tap(functools.partial(_summed, fn, dtype))
      fused[s] = fused[s]._replace(tap=tap)
  taps: list = []
  for s in range(len(plan.sites)):
    lead, aval = out_shapes[s]
    if s in gram_fns:
      taps.append(None)  # the shared tap, put in place inside tapped
      continue
    if s in fused:
      t = jax.tree.map(
        lambda x, lead=lead: jnp.zeros(lead + x.shape, x.dtype), stat_avals[s]
      )
      if weights is not None:  # the weights ride in on the tap
        w = jnp.broadcast_to(numerics.widen(weights), lead + weights.shape)
        t = {leaf: (w, sums) for leaf, (_, sums) in t.items()}
    else:
      t = jnp.zeros(lead + aval.shape, aval.dtype)
    # Under shard_map a tap must vary like its layer output: an invariant tap
    # would have its cotangent summed over devices, mixing examples.
    vma = numerics.varying_axes(aval)
    if axis_name is not None and axis_name not in vma:
      vma = vma + (axis_name,)
    if vma:
      t = jax.tree.map(lambda x, vma=vma: lax.pcast(x, vma, to="varying"), t)
    taps.append(t)

  def tapped(leaves, taps):
    acts: dict = {}
    if gram is not None:
      *taps, shared = taps
      taps = [shared if s in gram_fns else t for s, t in enumerate(taps)]
    outs = _eval(
      closed.jaxpr,
      closed.consts,
      [*leaves, *in_leaves],
      (),
      plan,
      taps,
      acts,
      fused,
    )
    return jax.tree_util.tree_unflatten(out_def, outs), (
      tuple(acts.get(s) for s in range(len(plan.sites))),
      tuple(
        tuple(acts.get(("derived", d, k)) for k in range(len(p.inputs)))
        for d, p in enumerate(plan.derived)
      ),
    )

  if weights is not None:
    # The forward pass does not read the weights, so XLA could run it next
    # to the pass that makes them, holding both passes' residuals. An
    # optimization barrier does not order it: XLA:CPU turns the barrier into
    # per-operand dependencies. The inputs, plus a zero read from the
    # weights, do.
    in_leaves = [_after(x, weights) for x in in_leaves]
  if gram is not None:
    taps.append(gram)  # its cotangent: the last of the taps'
  outputs, pullback, (acts, derived) = jax.vjp(
    tapped, tuple(leaves), tuple(taps), has_aux=True
  )
  fusion = None
  if statistic is not None and (fused_leaves or grads_leaves):
    fusion = _Fusion(
      statistic,
      weight_sharing,
      {**fused_leaves, **grads_leaves},
      weights,
      frozenset(grads_leaves),
    )
  return LayerTape(
    plan,
    treedef,
    leaves,
    covered,
    outputs,
    pullback,
    acts,
    batch,
    fusion,
    derived,
  )


@dataclasses.dataclass(frozen=True)
class _Fusion:
  """Leaves whose statistic a tape forms inside the backward pass."""

  statistic: str
  weight_sharing: str
  leaves: dict[int, tuple[int, str]]  # leaf -> (site, role)
  weights: Any = None  # statistic="combine": the (k, B) weights
  # Leaves whose per-example gradients the backward pass forms instead
  # (record's ``ordered`` with "gram"): they serve "gram" and combine.
  grads: frozenset[int] = frozenset()

  @property
  def statistic_leaves(self) -> dict[int, tuple[int, str]]:
    """The fused leaves whose tap holds ``statistic`` itself."""
    return {k: v for k, v in self.leaves.items() if k not in self.grads}


def _orders(site: _Site, aval: Any, batch: int) -> bool:
  """Whether ``record(..., ordered=True)`` runs an unscanned layer under
  :func:`_ordered_layer`.

  Where its input is larger than the statistics' chunk budget (the input
  is then freed before the next cotangent), and where the diagonal forms
  the kernel's per-example gradients (a conv, a dense layer shared over
  positions), whose sum replaces the kernel-gradient product
  (:func:`_ordered_stat`). Elsewhere ordering only cost time: 10-15% at B
  = 32 and 128 on the benchmark MLP."""
  if math.prod(aval.shape) > _PATCH_CHUNK_ELEMENTS or site.kind == "conv":
    return True
  if site.kind != "dense":
    return False
  act = jax.eval_shape(lambda a: _dense_act(site, a, batch), aval)
  return act.shape[1] > 1


def _fusable(
  plan: _Plan, statistic: str, ordered: Collection[int] = ()
) -> dict[int, tuple[int, str]]:
  """Leaf -> (site, role) for the leaves whose statistic can be formed in
  the backward pass: stacked along every scan around their one use, a
  dense, scale, shift, conv or per-head layer (for ``"kron"`` a conv or
  per-head kernel with K-FAC factors), at a site no other covered leaf
  needs. (K-FAC's ``A`` forms in the forward pass, :func:`_fused_inputs`.)
  With ``statistic="diag"``, also the kernels and biases of the dense and
  conv sites in ``ordered`` used once outside scans (:func:`_ordered_layer`)."""
  kinds = ("dense", "scale", "shift", "conv", "bdense")
  out: dict[int, tuple[int, str]] = {}
  for leaf, uses in plan.special.items():
    if len(uses) != 1:
      continue
    s, role, modes = uses[0]
    site = plan.sites[s]
    if role == "derived":  # per-example gradients and a VJP: not fused
      continue
    if statistic == "kron" and site.kind in _CHUNKED:
      if not _kron_ok(site, role):
        continue
    if modes and _stacked_only(modes) and site.kind in kinds:
      out[leaf] = (s, role)
  # Leaves used once outside scans: (leaf, site, role).
  once = []
  for leaf in range(len(plan.roles)):
    uses = plan.uses(leaf)
    if len(uses) == 1 and not uses[0][2] and uses[0][0] not in plan.site_loops:
      once.append((leaf, uses[0][0], uses[0][1]))
  if out and statistic in ("gram", "combine"):
    # Two passes run anyway: unscanned layers form their statistic in the
    # backward pass too, rather than hold every layer's cotangent.
    for leaf, s, role in once:
      if role != "derived" and plan.sites[s].kind in kinds:
        out[leaf] = (s, role)
  if ordered and statistic == "diag":  # the sites of _ordered_layer
    for leaf, s, role in once:
      kind = plan.sites[s].kind
      if (
        s in ordered
        and role in ("kernel", "bias")
        and kind in ("dense", "conv")
      ):
        out[leaf] = (s, role)
  return _sole_readers(plan, out)


def _sole_readers(
  plan: _Plan, chosen: dict[int, tuple[int, str]]
) -> dict[int, tuple[int, str]]:
  """``chosen`` (leaf -> (site, role)) without the leaves at sites that
  other covered leaves read ``(a, delta)`` from: a fused site records
  neither."""
  needed = set()
  for leaf in range(len(plan.roles)):
    if leaf not in chosen:
      needed.update(u[0] for u in plan.uses(leaf))
  return {leaf: v for leaf, v in chosen.items() if v[0] not in needed}


def _grads_fusable(
  plan: _Plan,
  leaves: Sequence[Any],
  act_avals: dict,
  out_shapes: dict,
  batch: int,
) -> dict[int, tuple[int, str]]:
  """Leaf -> (site, role) for :func:`record`'s per-example-gradient sites:
  conv, dense, scale and shift sites, outside scans or stacked along them,
  whose leaves each have that one use, that no other covered leaf reads,
  and whose ``(B, P)`` gradients (per layer) have fewer elements than what
  the site records (its input and output cotangent; a shift only the
  latter) and, all layers together, fit the chunk budget."""
  chosen: dict[int, tuple[int, str]] = {}
  for leaf in range(len(plan.roles)):
    uses = plan.uses(leaf)
    if len(uses) != 1:
      continue
    s, role, modes = uses[0]
    if not modes and s in plan.site_loops:  # shared by a loop's iterations
      continue
    if _stacked_only(modes) and role != "derived":
      if plan.sites[s].kind in _GRADS_KINDS:
        chosen[leaf] = (s, role)
  out: dict[int, tuple[int, str]] = {}
  for s, users in _by_site(_sole_readers(plan, chosen)).items():
    lead, delta = out_shapes[s]
    held = math.prod(delta.shape)
    if plan.sites[s].kind != "shift":
      held += math.prod(act_avals[s].shape)
    size = sum(math.prod(np.shape(leaves[k])) for k in users)
    grads = batch * size // max(1, math.prod(lead))  # one layer's
    if grads < held and batch * size <= DEFAULT_CHUNK_ELEMENTS:
      out.update((leaf, (s, role)) for leaf, role in users.items())
  return out


def _grads_stat(
  site: _Site,
  users: list[tuple[int, str, tuple[int, ...]]],
  batch: int,
  chunk_size: int | None,
  act: Array | None,
  delta: Array,
) -> dict[int, Array]:
  """The per-example gradients ``(B, *shape)`` of each leaf at a conv,
  dense, scale or shift site, from its input and output cotangent (one
  sample): a conv kernel's a chunk of examples at a time."""
  _, x, d, _ = _site_view(site, act, delta[None], batch)
  out = {}
  for leaf, role, shape in users:
    if site.kind == "conv":
      assert x is not None
      g = _conv_example_grads(site.eqn, x, d[0], chunk_size)
    elif site.kind == "dense" and role == "kernel":
      g = _kernel_to_shape(site, jnp.einsum("btk,bto->bko", x, d[0]), shape)
    else:  # a bias, or an elementwise leaf: summed over positions
      g = jnp.sum(d[0], axis=1)
    out[leaf] = g.reshape((batch,) + shape)
  return out


def _ordered_grads(
  grads_fn: Callable[..., dict], kernel: int, act: Array, delta: Array
) -> tuple[dict[int, Array], Array]:
  """``(grads, dw)`` for :func:`_ordered_layer`: a conv or dense site's
  per-example gradients and its ``kernel`` leaf's cotangent, their sum."""
  grads = grads_fn(act, delta)
  return grads, jnp.sum(grads[kernel], axis=0)


def _by_site(fused: dict[int, tuple[int, str]]) -> dict[int, dict[int, str]]:
  """site -> {leaf: role} of the fused leaves."""
  out: dict[int, dict[int, str]] = {}
  for leaf, (s, role) in sorted(fused.items()):
    out.setdefault(s, {})[leaf] = role
  return out


def _fused_stat(
  site: _Site,
  users: list[tuple[int, str, tuple[int, ...]]],
  batch: int,
  statistic: str,
  chunk_size: int | None,
  reduce: bool,
  act: Array | None,
  delta: Array,
  tap: Any = None,
) -> dict[int, Any]:
  """One iteration's statistic of each leaf at a site: ``{leaf: diag}``,
  ``{leaf: Gamma_sum}`` (K-FAC's ``A_sum``: :func:`_fused_inputs`),
  ``{leaf: gram}`` (``(B, B)``) or, for ``"combine"``, ``{leaf: (0, sum_n
  w[:, n] g_n)}`` with the weights ``w`` read from the tap (``{leaf: (w,
  _)}``). For ``"kron"``, an elementwise leaf's per-example gradients
  ``(B, *shape)`` instead (they are small, and give its Shampoo-style
  factors), other leaves without K-FAC factors left out."""
  view = _site_view(site, act, delta[None], batch)
  out: dict[int, Any] = {}
  for leaf, role, shape in users:
    if site.kind == "conv" and statistic == "kron":  # A: _fused_inputs
      out[leaf] = _conv_kron_gamma(site.eqn, delta[None], batch, reduce)
    elif site.kind == "conv":  # S = 1 (one backward iteration)
      assert act is not None
      w = tap[leaf][0] if statistic == "combine" else None
      val = _conv_stat(site.eqn, act, view[2], shape, statistic, chunk_size, w)
      out[leaf] = val if w is None else (jnp.zeros_like(w), val)
    elif site.kind == "bdense" and statistic == "kron":  # A: _fused_inputs
      gamma = _heads_kron_gamma(view[2], reduce)
      out[leaf] = gamma.reshape(shape[: site.heads] + gamma.shape[-2:])
    elif site.kind == "bdense":
      w = tap[leaf][0] if statistic == "combine" else None
      val = _heads_stat(view, shape, statistic, chunk_size, w)
      out[leaf] = val if w is None else (jnp.zeros_like(w), val)
    elif statistic == "diag":
      out[leaf] = _diag_stat(view, role, shape, chunk_size)
    elif statistic == "gram":
      out[leaf] = _gram_stat(view, role, chunk_size)
    elif statistic == "combine":
      w = tap[leaf][0]
      out[leaf] = (jnp.zeros_like(w), _combine_stat(view, role, w, shape))
    elif site.kind in _ELEMENTWISE:  # its per-example gradients
      spec = [(leaf, role, shape)]
      out[leaf] = _grads_stat(site, spec, batch, chunk_size, act, delta)[leaf]
    elif _kron_ok(site, role):  # A_sum: in the forward pass (_fused_inputs)
      out[leaf] = _kron_gamma(view[2], reduce)
  return out


def _ordered_stat(
  site: _Site,
  users: list[tuple[int, str, tuple[int, ...]]],
  batch: int,
  chunk_size: int | None,
  act: Array,
  delta: Array,
) -> tuple[dict[int, Any], Array | None]:
  """An unscanned layer's diagonals (as :func:`_fused_stat`) and the
  cotangent of its kernel where the diagonal forms per-example gradients
  (a conv, a dense layer shared over positions): their sum (else ``None``).

  So the backward pass runs no kernel-gradient convolution or matmul. A
  convolution's input XLA:CPU copies to another layout in the forward
  pass, and the statistic's slices and that copy would both hold the
  layer's input."""
  view = _site_view(site, act, delta[None], batch)
  shared = site.kind == "conv" or (
    site.kind == "dense" and view[1] is not None and view[1].shape[1] > 1
  )
  # The kernel's gradients' sum is its operand's cotangent only when the
  # operand is the leaf itself (a transposed or scaled view differs).
  kernel = [u for u in users if shared and site.direct and u[1] == "kernel"]
  rest = [u for u in users if u not in kernel]
  out = _fused_stat(site, rest, batch, "diag", chunk_size, False, act, delta)
  dw = None
  for leaf, _, shape in kernel:
    _, x, d, _ = view
    assert x is not None
    if site.kind == "conv":
      both = _conv_diag(site.eqn, x, d, shape, chunk_size, with_sum=True)
      out[leaf], dw = both[0], both[1]
    else:
      sq, g = _shared_dense_sums(x, d, chunk_size)
      out[leaf], dw = (_kernel_to_shape(site, v, shape) for v in (sq, g))
  return out, dw


def _heads_stat(
  view, shape: tuple, statistic: str, chunk_size, weights: Array | None
) -> Array:
  """One backward iteration's ``"diag"``, ``"gram"`` or ``"combine"`` of a
  per-head kernel, ``shape``d (the Gram ``(B, B)``), from its view (``act``
  ``(B, H, T, K)``, one sample's ``delta`` ``(1, B, H, T, O)``): the
  per-example gradients ``(c, H, K, O)`` formed a chunk of examples at a
  time (``chunk_size``, or as many as keep them in cache, as for a conv)."""
  site, act, delta, _ = view
  delta = delta[0]
  b, heads, k, o = act.shape[0], act.shape[1], act.shape[-1], delta.shape[-1]
  chunk = chunk_size or max(1, _PATCH_CHUNK_ELEMENTS // (heads * k * o))
  grads = lambda a, d: jnp.einsum("chtk,chto->chko", a, d)
  to_leaf = lambda g: _kernel_to_shape(
    site, g.reshape(g.shape[:-3] + (heads * k, o)), shape
  )
  dtype = jnp.promote_types(act.dtype, delta.dtype)
  if statistic == "gram":
    g = _chunk_map(
      lambda a, d: grads(a, d).reshape(a.shape[0], -1), [act, delta], chunk
    )
    return g @ g.T
  if statistic == "diag":
    square = lambda a, d: jnp.sum(grads(a, d) ** 2, axis=0)
    total = _sum_over_example_chunks(
      square, [act, delta], [0, 0], b, chunk, (heads, k, o), dtype
    )
    return to_leaf(total)
  assert weights is not None
  dtype = jnp.promote_types(dtype, weights.dtype)
  part = lambda w, a, d: jnp.tensordot(w, grads(a, d), 1)
  total = _sum_over_example_chunks(
    part,
    [weights, act, delta],
    [1, 0, 0],
    b,
    chunk,
    (weights.shape[0], heads, k, o),
    dtype,
  )
  return to_leaf(total)


def _fused_inputs(
  site: _Site,
  users: list[tuple[int, str, tuple[int, ...]]],
  batch: int,
  reduce: bool,
  act: Array,
  out: Array,
) -> dict[int, Array]:
  """K-FAC's ``A_sum`` of each leaf at a site whose ``Gamma_sum`` forms in
  the backward pass, formed in the forward pass from its activations
  (``out``, the layer's output, gives only the view's shape): formed once,
  where each backward pass of several samples would form it again."""
  if site.kind == "conv":  # one use, a kernel with K-FAC factors (_fusable)
    (leaf, _, _), *_ = users
    return {leaf: _conv_kron_input(site.eqn, act, batch, reduce)}
  view = _site_view(site, act, out[None], batch)
  if site.kind == "bdense":  # per head (_fusable: K-FAC factors)
    (leaf, _, shape), *_ = users
    assert view[1] is not None
    a_sum = _heads_kron_a(view[1], reduce)
    return {leaf: a_sum.reshape(shape[: site.heads] + a_sum.shape[-2:])}
  return {
    leaf: _kron_input(view, role, batch, reduce)
    for leaf, role, _ in users
    if _kron_ok(site, role)
  }


class _FusedSite(NamedTuple):
  """How :func:`_eval` runs a site whose statistic forms in the backward
  pass: its output through ``tap`` (:func:`_fused_tap`), the activation
  kept for the backward pass when ``needs_act``, and ``forward(act, out)``
  (if any) recorded in the forward pass in place of the activation."""

  tap: Callable[..., Any]
  needs_act: bool
  forward: Callable[[Array, Array], Any] | None = None
  ordered: Callable[..., Any] | None = None  # stat_fn of an unscanned layer
  shared: bool = False  # its tap is the tape's one Gram tap, never sliced


def _summed(stat_fn: Callable[..., dict], dtype: Any, *args) -> Array:
  """The sum of the values ``stat_fn(*args)`` returns per leaf, in ``dtype``
  (``None``: theirs)."""
  vals = list(stat_fn(*args).values())
  total = functools.reduce(jnp.add, vals[1:], vals[0])
  return total if dtype is None else total.astype(dtype)


def _fused_tap(stat_fn: Callable[..., Any], reads_tap: bool = False):
  """``tap(z, a, t) = z`` whose backward also returns ``stat_fn(a, dz)`` as
  the cotangent of ``t``: a statistic formed where ``dz`` is made, inside
  a scan's backward iteration (and after a remat body's recomputation).
  With ``reads_tap``, ``stat_fn(a, dz, t)``: the tap carries inputs of the
  statistic (``combine``'s weights) into the backward pass."""

  @jax.custom_vjp
  def tap(z, a, t):
    del a, t
    return z

  def fwd(z, a, t):
    return z, (a, t if reads_tap else None)

  def bwd(res, dz):
    a, t = res
    stat = stat_fn(a, dz, t) if reads_tap else stat_fn(a, dz)
    return dz, None, stat

  tap.defvjp(fwd, bwd)
  return tap


def _after(x: Array, tree: Any) -> Array:
  """``x``, computed after ``tree``: plus a zero made from one of its
  elements (``0 * isfinite``, so exactly zero, never NaN)."""
  leaf = jax.tree.leaves(tree)[0]
  zero = jnp.isfinite(jnp.ravel(leaf)[0]).astype(x.dtype) * 0
  return x + zero


def _ordered_layer(stat_fn, bind, act_index: int):
  """``layer(x0, x1, act, t) = bind([x0, x1])[0]``, one operand the activation
  (``act_index``), the other the parameter, whose backward returns the
  statistic of ``stat_fn(act, dz) = (stat, dw)`` as ``t``'s cotangent and
  pulls back the activation's cotangent after the statistic and the
  parameter's cotangent (``dw``, or a VJP where it is ``None``).

  Both read the layer's input, which can then be freed before the next
  cotangent is written; left to itself XLA:CPU ran the statistic after it
  and held both. The order rides on the parameter operand (small), made to
  depend on both results (:func:`_after`)."""

  def out(ops) -> Array:
    return bind(list(ops))[0]

  @jax.custom_vjp
  def layer(x0, x1, act, t):
    del act, t
    return out([x0, x1])

  def fwd(x0, x1, act, t):
    del t
    return out([x0, x1]), (x0, x1, act)

  def bwd(res, dz):
    x0, x1, act = res
    ops, p = (x0, x1), 1 - act_index
    stat, dw = stat_fn(act, dz)
    if dw is None:
      dw = jax.vjp(lambda w: out(_put(ops, p, w)), ops[p])[1](dz)[0]
    else:
      dw = dw.reshape(ops[p].shape).astype(ops[p].dtype)
    kernel = _after(ops[p], dw)
    ops = _put(
      ops, p, _after(kernel, stat) if jax.tree.leaves(stat) else kernel
    )
    x = ops[act_index]
    dx = jax.vjp(lambda x: out(_put(ops, act_index, x)), x)[1](dz)[0]
    return (*_put(_put((None, None), p, dw), act_index, dx), None, stat)

  layer.defvjp(fwd, bwd)
  return layer


# --------------------------------------------------------------------------
# Statistics from (a, delta).


def _kron_ok(site: _Site, role: str) -> bool:
  """Whether K-FAC factors of a covered leaf fit a row-major matrix view.

  A :class:`KroneckerFisher` views a leaf as ``(m, n)`` from its factors'
  sizes, leading axes as rows: a kernel's factors ``(K, K)`` and ``(O, O)``
  fit when its contracted axes lead and its output axes trail (``Dense``,
  ``DenseGeneral``, attention ``q``/``k``/``v`` ``(d, heads, head_dim)``
  and output ``(heads, head_dim, d)`` projections); a conv kernel's
  ``(patch, patch)`` and ``(O, O)`` when it is ``HWIO``-like with one
  feature group; a bias's ``[[B]]`` and ``(O, O)`` always. An elementwise
  scale or shift has no K-FAC rule (Shampoo factors from its per-example
  gradients are already its exact block when it is a vector).
  """
  if role == "derived":  # a VJP per example: no factors
    return False
  if site.kind == "conv":
    return _conv_kron_ok(site.eqn)
  if site.kind in ("scale", "shift"):
    return False
  if role == "bias" or site.kind == "embed":
    return True
  return site.leaf_perm == tuple(range(len(site.leaf_perm)))


def _conv_kron_ok(eqn) -> bool:
  """A conv kernel's matrix view ``(prod(spatial) * I, O)`` is the K-FAC
  ``(patch, O)`` layout: spatial axes, then input, then output (``HWIO``),
  one feature group."""
  rhs = tuple(eqn.params["dimension_numbers"].rhs_spec)
  n = len(rhs)
  return eqn.params["feature_group_count"] == 1 and rhs == (
    n - 1,
    n - 2,
    *range(n - 2),
  )


def _conv_patches(eqn, x: Array) -> Array:
  """``(B, *out_spatial, S, I)`` input patches of a convolution.

  ``S`` runs over the kernel's spatial offsets (row-major, in the kernel's
  spatial axis order) and ``I`` over all input channels. Built from strided
  slices of the padded (and lhs-dilated) input: memory passes only, where
  ``lax.conv_general_dilated_patches`` runs a convolution with an identity
  kernel (on XLA:CPU several times slower than the gradient itself).
  """
  p = eqn.params
  dn = p["dimension_numbers"]
  lhs, rhs = tuple(dn.lhs_spec), tuple(dn.rhs_spec)
  out = eqn.outvars[0].aval.shape
  w = eqn.invars[1].aval.shape
  window = tuple(w[i] for i in rhs[2:])
  out_sp = tuple(out[i] for i in dn.out_spec[2:])
  x = jnp.transpose(x, (lhs[0], *lhs[2:], lhs[1]))  # (B, spatial..., I)
  zero = jnp.zeros((), x.dtype)
  config = [(0, 0, 0)]
  for (lo, hi), dil in zip(p["padding"], p["lhs_dilation"]):
    config.append((lo, hi, dil - 1))
  x = lax.pad(x, zero, config + [(0, 0, 0)])
  b, c = x.shape[0], x.shape[-1]
  slices = []
  for offset in np.ndindex(*window):
    start = [0] + [k * d for k, d in zip(offset, p["rhs_dilation"])] + [0]
    limit = (
      [b]
      + [
        s0 + st * (n - 1) + 1
        for s0, st, n in zip(start[1:-1], p["window_strides"], out_sp)
      ]
      + [c]
    )
    slices.append(lax.slice(x, start, limit, (1, *p["window_strides"], 1)))
  return jnp.stack(slices, axis=-2)


def _patch_chunk(eqn, chunk_size: int | None) -> int:
  """Examples per chunk of a conv's input patches: ``chunk_size``, or as
  many as keep their patches in cache."""
  return chunk_size or max(1, _PATCH_CHUNK_ELEMENTS // _patch_elements(eqn))


def _patch_elements(eqn) -> int:
  """Elements of one example's :func:`_conv_patches`."""
  dn = eqn.params["dimension_numbers"]
  out, w = eqn.outvars[0].aval.shape, eqn.invars[1].aval.shape
  x = eqn.invars[0].aval.shape
  positions = math.prod(out[i] for i in dn.out_spec[2:])
  window = math.prod(w[i] for i in dn.rhs_spec[2:])
  return positions * window * x[dn.lhs_spec[1]]


def _gram_by_input_blocks(
  a: Array, d: Array, chunk_size, num_rows: int | None = None
) -> Array:
  """``sum <g_i, g_j>`` of a weight-shared kernel from its per-example
  gradients ``g = a^T d``, formed for a block of input features at a time.

  ``a`` is ``(B, T, K)`` (or, for an embedding table of ``num_rows`` rows,
  the ``(B, T)`` ids: ``a`` their one-hot rows, built a block at a time),
  ``d`` ``(S, B, T, O)``. A block holds ``S * B * k_blk * O`` elements, at
  most the chunk budget (``chunk_size`` examples' gradients, else the
  default), so memory does not grow with ``B * K``.
  """
  num_s, b, _, o = d.shape
  k, n = (a.shape[-1] if num_rows is None else num_rows), num_s * b
  budget = chunk_size * k * o if chunk_size else _BLOCK_ELEMENTS
  blk = max(1, min(k, budget // (n * o)))
  count = -(-k // blk)
  dtype = jnp.promote_types(a.dtype, d.dtype) if num_rows is None else d.dtype
  if num_rows is None:
    a = jnp.pad(a, ((0, 0), (0, 0), (0, count * blk - k)))

  def gram(i):
    if num_rows is None:
      a_i = lax.dynamic_slice_in_dim(a, i * blk, blk, axis=2)
    else:  # one-hot rows i * blk ... of the ids (padding rows match none)
      a_i = (a[..., None] == i * blk + jnp.arange(blk)).astype(dtype)
    g = jnp.einsum("nti,sntj->snij", a_i, d).reshape(n, -1)
    return g @ g.T

  if count == 1:
    return gram(0)
  return _loop_sum(gram, count, (n, n), dtype, [d, a])


def _gram_stat(site_view, role: str, chunk_size) -> Array:
  """``sum <g_i, g_j>`` ``(S * B, S * B)`` of one use, from its view."""
  site, act, delta, _ = site_view
  num_s, b, t, d_out = delta.shape
  rows = delta.reshape(num_s * b, t, d_out)
  if role == "bias":
    g = jnp.sum(rows, axis=1)
    return g @ g.T
  if site.kind == "embed":
    if (num_s * b * t) ** 2 > _BLOCK_ELEMENTS:
      return _gram_by_input_blocks(act, delta, chunk_size, site.num_rows)
    ka = (act[:, None, :, None] == act[None, :, None, :]).astype(
      delta.dtype
    )  # (B, B, T, T)
  else:
    d_in, n = act.shape[-1], num_s * b
    ghost = n * n * t * t
    if t > 1 and (d_in * d_out < n * t * t or ghost > _BLOCK_ELEMENTS):
      return _gram_by_input_blocks(act, delta, chunk_size)
    ka = jnp.einsum("ntd,mud->nmtu", act, act)
  kd = jnp.einsum("itd,jud->ijtu", rows, rows).reshape(num_s, b, num_s, b, t, t)
  return jnp.einsum("nmtu,snrmtu->snrm", ka, kd).reshape(num_s * b, num_s * b)


def _row_gram_ok(site_view, role: str) -> bool:
  """Whether a use's Gram matrix is a product of row Gram matrices: a bias
  or an elementwise leaf (``g = sum_t delta``), or a dense kernel without
  weight sharing (``(A A^T) * (D D^T)``)."""
  site, act, delta, _ = site_view
  if role == "bias":
    return True
  return site.kind == "dense" and act is not None and delta.shape[2] == 1


def _row_gram_term(site_view, roles: list[str]):
  """``(a, r, plus_one)`` of the uses at one site: their Gram is ``((a
  a^T) + plus_one) * (r r^T)`` (``a`` ``None``: ``r r^T``), rows of ``r``
  ``s * B + n``, ``a`` ``(B, K)``."""
  _, act, delta, _ = site_view
  r = jnp.sum(delta, axis=2)
  r = r.reshape(-1, r.shape[-1])
  kernel = any(role != "bias" for role in roles)
  return (act[:, 0] if kernel else None), r, kernel and "bias" in roles


def _rows_gram(terms: list, n: int, b: int) -> Array:
  """``sum`` of :func:`_row_gram_term` Gram matrices ``(n, n)``, formed by
  blocks of rows (:func:`_chunk_map`): each site's row products live for a
  block at a time, not as ``(n, n)`` matrices per leaf (on the MLP at ``B =
  2048``, nine of them at once)."""
  dtype = jnp.result_type(*(x for t in terms for x in t[:2] if x is not None))

  def block(rows, *r_rows):  # rows s * B + m read example m's activations
    out = None
    for (a, r, plus_one), r_i in zip(terms, r_rows):
      prod = r_i @ r.T
      if a is not None:
        aa = jnp.tile(a[rows % b] @ a.T, (1, n // b))
        prod = (aa + 1 if plus_one else aa) * prod
      out = prod if out is None else out + prod
    assert out is not None
    return out.astype(dtype)

  r_all = [r for _, r, _ in terms]
  # XLA runs every site's products before the fusion that sums them: the
  # block's row count keeps all of them within the budget.
  chunk = max(1, _BLOCK_ELEMENTS // (2 * len(terms) * n))
  return _chunk_map(block, [jnp.arange(n), *r_all], chunk)


def _combine_dense(w: Array, a: Array, d: Array) -> Array:
  """``sum_{s,n} w[k, s, n] a_n^T d_{s,n}``, ``(k, K, O)``, for ``a`` ``(B,
  T, K)`` and ``d`` ``(S, B, T, O)``.

  The weighted operand (``k`` times the activations or the cotangents) is
  formed for a chunk of examples at a time when it would pass the default
  budget, the chunks' products summed.
  """
  k, num_s, b = w.shape
  t, i, j = a.shape[1], a.shape[-1], d.shape[-1]

  def part(w_c, a_c, d_c):
    if num_s == 1:
      # Weighting the activations puts k and i on one operand, so the
      # matmul writes (k, i, j) as it is returned: no transposed copy of
      # the k x P result (the dominant memory traffic here).
      wa = jnp.einsum("kn,nti->knti", w_c[:, 0], a_c.astype(w.dtype))
      return jnp.einsum("knti,ntj->kij", wa, d_c[0])
    # Sum the S cotangents per example first: k matmuls over (n, t).
    wd = jnp.einsum("ksn,sntj->kntj", w_c, d_c)
    return jnp.einsum("nti,kntj->kij", a_c, wd)

  chunk = max(1, _BLOCK_ELEMENTS // (k * t * (i if num_s == 1 else j)))
  dtype = jnp.promote_types(w.dtype, jnp.promote_types(a.dtype, d.dtype))
  return _sum_over_example_chunks(
    part, [w, a, d], [2, 0, 1], b, chunk, (k, i, j), dtype
  )


def _even_chunk(b: int, chunk: int) -> int:
  """A chunk of at most ``chunk`` examples, a divisor of ``b`` when one of
  at least half that size exists (no remainder to run apart)."""
  chunk = max(1, min(chunk, b))
  for c in range(chunk, (chunk + 1) // 2 - 1, -1):
    if b % c == 0:
      return c
  return chunk


def _sum_over_example_chunks(
  fn: Callable[..., Array],
  arrays: Sequence[Array],
  axes: Sequence[int],
  b: int,
  chunk: int,
  shape: tuple,
  dtype: Any,
) -> Array:
  """``sum_j fn(*chunk j of arrays)``, each array's ``b`` examples along its
  axis in ``axes``, ``chunk`` at a time, one chunk's terms live at a time
  (a ``scan`` over the whole chunks, then the remainder); ``fn(*arrays)``
  when one chunk holds them all. Slices, never a padded copy of the
  arrays."""
  chunk = _even_chunk(b, chunk)
  count, rest = divmod(b, chunk)
  if count == 1 and not rest:
    return fn(*arrays)

  def one(j):
    return fn(
      *(
        lax.dynamic_slice_in_dim(x, j * chunk, chunk, axis)
        for x, axis in zip(arrays, axes)
      )
    )

  total = _loop_sum(one, count, shape, dtype, arrays, after=False)
  if rest:
    tail = (
      lax.slice_in_dim(x, count * chunk, b, axis=axis)
      for x, axis in zip(arrays, axes)
    )
    total = total + fn(*tail).astype(dtype)
  return total


def _combine_stat(site_view, role: str, weights: Array, shape: tuple) -> Array:
  """``sum_i weights[:, i] g_i`` ``(k, *shape)`` of one use, from its view;
  ``weights`` ``(k, S * B)``, columns ``i = s * B + n``."""
  site, act, delta, _ = site_view
  num_s, b = delta.shape[:2]
  w = numerics.widen(weights).astype(
    jnp.promote_types(weights.dtype, delta.dtype)
  )
  w = w.reshape(-1, num_s, b)
  k = w.shape[0]
  if role == "bias":
    val = jnp.einsum("ksn,sntd->kd", w, delta)
  elif site.kind == "embed":
    assert act is not None  # the ids
    wd = jnp.einsum("ksn,sntd->kntd", w, delta)
    val = (
      jnp.zeros((k,) + shape, wd.dtype)
      .at[:, act.reshape(-1)]
      .add(wd.reshape(k, -1, shape[-1]))
    )
  else:
    val = _kernel_to_shape(site, _combine_dense(w, act, delta), shape)
  return val.reshape((k,) + shape)


def _xla_cpu() -> bool:
  """Whether the computation compiles for XLA:CPU, whose slow paths some
  statistics avoid (:func:`_loop_over_examples`, :func:`_bind_conv`)."""
  return jax.default_backend() == "cpu"


def _loop_over_examples() -> bool:
  """Whether per-example kernel products run as a loop of 2-D matmuls.

  On XLA:CPU, batched ``dot_general`` products of many examples and their
  squares ran 8-9x slower than a scan of 2-D matmuls accumulating the
  squares (``(128, 32, 128) x (128, 32, 512)``), which also never holds
  more than one example's gradient; accelerators keep the batched
  product.
  """
  return _xla_cpu()


def _sum_sq_example_grads(a: Array, d: Array, with_sum: bool = False) -> Any:
  """``sum_{s,n} (a_n^T d_{s,n})^2`` for ``a`` ``(B, T, K)`` and ``d`` ``(S,
  B, T, O)``: a scan over examples, one ``(K, T) x (T, S * O)`` matmul each.
  ``with_sum`` (one sample): and ``sum_n a_n^T d_n``, the kernel's
  cotangent.

  The loop reads ``a`` as ``(B * T, K)``, the matrix the layer's own matmul
  reads: where ``a`` is a transposed value (attention's heads merged before
  the output projection), XLA:CPU then makes one row-major copy of it for
  both, where a ``(B, T, K)`` operand got a second, held to the backward
  pass."""
  dtype = jnp.promote_types(a.dtype, d.dtype)
  t = a.shape[1]
  flat = a.reshape(-1, a.shape[-1])

  def one(n):
    a_n = lax.dynamic_slice_in_dim(flat, n * t, t, axis=0)  # (T, K)
    d_n = lax.dynamic_index_in_dim(d, n, axis=1, keepdims=False)  # (S, T, O)
    g = jnp.einsum("tk,sto->kso", a_n, d_n)
    return jnp.sum(g * g, axis=1), g[:, 0]

  shape = (a.shape[-1], d.shape[-1])
  if with_sum:
    assert d.shape[0] == 1
    return _loop_sums(one, a.shape[0], (shape, shape), dtype, [flat, d])
  return _loop_sum(lambda n: one(n)[0], a.shape[0], shape, dtype, [flat, d])


def _shared_dense_sums(
  a: Array, d: Array, chunk_size: int | None
) -> tuple[Array, Array]:
  """``(sum_n g_n^2, sum_n g_n)`` ``(K, O)`` of a weight-shared dense
  kernel, ``g_n = a_n^T d_n``, from ``a`` ``(B, T, K)`` and one sample's
  ``d`` ``(1, B, T, O)``: the diagonal and the kernel's cotangent from the
  same per-example gradients."""
  if _loop_over_examples():
    return _sum_sq_example_grads(a, d, with_sum=True)
  both = _chunked_example_sums(a, d[0], chunk_size, with_sum=True)
  return both[0], both[1]


def _chunked_example_sums(
  a: Array, d: Array, chunk_size: int | None, with_sum: bool = False
) -> Array:
  """``sum_n g_n^2``, and with ``with_sum`` ``sum_n g_n``, stacked ``(1 or
  2, K, O)``, ``g_n = a_n^T d_n`` for ``a`` ``(B, T, K)`` and one sample's
  ``d`` ``(B, T, O)``: chunks of batched products (accelerators). One call
  per sample keeps the (possibly sharded) batch axis unmerged."""
  k, o = a.shape[-1], d.shape[-1]
  chunk = chunk_size or max(1, DEFAULT_CHUNK_ELEMENTS // (k * o))

  def part(a, d):
    g = jnp.einsum("cti,ctj->cij", a, d)
    sums = [jnp.sum(g**2, axis=0)] + ([jnp.sum(g, axis=0)] if with_sum else [])
    return jnp.stack(sums)[None]

  return jnp.sum(_chunk_map(part, [a, d], chunk), axis=0)


def _conv_kernel_grads(eqn, x: Array, delta: Array, shared: int = 1) -> Array:
  """Per-example kernel gradients ``(c, *kernel)`` of a convolution.

  ``x`` are ``c * shared`` inputs and ``delta`` their output cotangents,
  both in the equation's layouts, example-major: ``shared`` applications of
  the kernel per example (a scan's iterations that share it), whose
  gradients add up. One contraction of the input patches with ``delta``
  over the output positions of every application, per feature group.
  """
  p = eqn.params
  dn = p["dimension_numbers"]
  rhs = tuple(dn.rhs_spec)
  w = eqn.invars[1].aval.shape
  groups = p["feature_group_count"]
  dtype = jnp.promote_types(x.dtype, delta.dtype)
  patches = _conv_patches(eqn, x.astype(dtype))
  c, s, i_all = patches.shape[0] // shared, patches.shape[-2], patches.shape[-1]
  patches = patches.reshape(c, -1, s, groups, i_all // groups)
  out = dn.out_spec
  delta = jnp.transpose(delta.astype(dtype), (out[0], *out[2:], out[1]))
  o = delta.shape[-1]
  delta = delta.reshape(c, -1, groups, o // groups)
  g = jnp.einsum("ctsgi,ctgo->csigo", patches, delta)
  window = tuple(w[k] for k in rhs[2:])
  g = g.reshape((c, *window, i_all // groups, o))
  # Axes now follow the kernel's (spatial..., I, O) dims; put them in place.
  order = (*rhs[2:], rhs[1], rhs[0])
  return jnp.transpose(g, (0, *(1 + int(k) for k in np.argsort(order))))


def _chunk_map(
  fn: Callable[..., Array], xs: Sequence[Array], chunk: int
) -> Array:
  """``fn`` over row chunks of ``xs`` (a loop over the whole chunks, then
  the remainder; no padded copy), results concatenated.

  The loop writes into zeros made after ``xs[-1]``: as ``lax.map``'s own
  output buffer, XLA:CPU allocated them at the program's start, live
  through the forward pass (a conv's per-example gradients, the Gram
  matrix's row blocks)."""
  n = xs[0].shape[0]
  chunk = _even_chunk(n, chunk)
  count, rest = divmod(n, chunk)
  if count == 1 and not rest:
    return fn(*xs)

  def part(j):
    return fn(*(lax.dynamic_slice_in_dim(x, j * chunk, chunk, 0) for x in xs))

  one = jax.eval_shape(part, 0)
  r = one.shape[0]
  tail = None
  if rest:
    tail = fn(*(x[count * chunk :] for x in xs))
  rows = count * r + (tail.shape[0] if tail is not None else 0)
  out = _zeros_varying((rows, *one.shape[1:]), one.dtype, xs)
  out = _after(out, xs[-1])

  def write(j, out):
    return lax.dynamic_update_slice_in_dim(out, part(j), j * r, 0)

  out = lax.fori_loop(0, count, write, out)
  if tail is not None:
    out = lax.dynamic_update_slice_in_dim(out, tail, count * r, 0)
  return out


def _dense_act(site: _Site, act: Array, b: int) -> Array:
  """A dense site's input as ``(B, T, K)``."""
  act = jnp.transpose(numerics.widen(act), site.x_perm)
  k = math.prod(act.shape[act.ndim - len(site.leaf_perm) + site.num_free :])
  return act.reshape(b, -1, k)


def _site_view(site: _Site, act: Any, delta: Array, b: int):
  """The statistics' view of a site: ``(site, act, delta, valid)``.

  ``act`` (B, T, K) or ids (B, T); ``delta`` (S, B, T, O). An elementwise
  parameter takes the bias role: delta (S, B, R, P), its example gradient
  the sum over the R broadcast positions, P in leaf order.
  """
  delta = numerics.widen(delta)
  if site.kind == "conv":  # a (B, ...) and delta (S, B, ...) as laid out
    return site, numerics.widen(act), delta, None
  if site.kind == "bdense":  # a (B, H, T, K), delta (S, B, H, T, O)
    delta = jnp.transpose(delta, (0, *(1 + i for i in site.out_perm)))
    heads = math.prod(delta.shape[2 : 2 + site.heads])
    o = math.prod(delta.shape[delta.ndim - site.num_free :])
    delta = delta.reshape(delta.shape[0], b, heads, -1, o)
    if act is not None:
      act = jnp.transpose(numerics.widen(act), site.x_perm)
      k = math.prod(
        act.shape[act.ndim - len(site.leaf_perm) + site.num_free + site.heads :]
      )
      act = act.reshape(b, heads, -1, k)
    return site, act, delta, None
  if site.kind == "dense":
    delta = jnp.transpose(delta, (0, *(1 + i for i in site.out_perm)))
    o = math.prod(delta.shape[delta.ndim - site.num_free :])
    delta = delta.reshape(delta.shape[0], b, -1, o)
    act = None if act is None else _dense_act(site, act, b)
    return site, act, delta, None
  if site.kind in ("scale", "shift"):
    if site.kind == "scale":  # d(x * p)/dp = x, broadcast like the output
      x = jnp.broadcast_to(numerics.widen(act), delta.shape[1:])
      # One sample without a broadcast over S: XLA:CPU turns a product with
      # a broadcast operand, reduced over positions, into a fused reduction
      # about 6x slower (a LayerNorm scale at B=32, T=32, d=128: 0.71 ms
      # against 0.11 ms).
      delta = (delta[0] * x)[None] if delta.shape[0] == 1 else delta * x
    axes = range(1, delta.ndim - 1)
    summed = [1 + i for i in axes if site.compact[i] == 1]
    kept = [1 + i for i in axes if site.compact[i] != 1]
    delta = jnp.transpose(delta, (0, 1, *summed, *kept))
    p = math.prod(site.compact)
    return site, None, delta.reshape(delta.shape[0], b, -1, p), None
  delta = delta.reshape(delta.shape[0], b, -1, delta.shape[-1])
  ids = act.reshape(b, -1).astype(jnp.int32)
  rows = site.num_rows
  if site.mode == lax.GatherScatterMode.CLIP:
    ids = jnp.clip(ids, 0, rows - 1)
    valid = jnp.ones(ids.shape, bool)
  else:  # out-of-range rows are filled on the way in, dropped on the way out
    valid = (ids >= 0) & (ids < rows)
    ids = jnp.where(valid, ids, 0)
  delta = delta * valid[None, :, :, None]
  return site, ids, delta, valid


def _kernel_to_shape(site: _Site, val: Array, shape: tuple) -> Array:
  """A ``(..., K, O)`` kernel statistic as ``(..., *shape)``, ``shape`` the
  leaf's (or one layer's, for a stacked leaf)."""
  lead = val.shape[:-2]
  val = val.reshape(lead + tuple(shape[i] for i in site.leaf_perm))
  inverse = [len(lead) + int(i) for i in np.argsort(site.leaf_perm)]
  return jnp.transpose(val, (*range(len(lead)), *inverse))


def _summed_sq(delta: Array) -> Array:
  """``sum_s delta^2`` ``(B, O)`` of a dense use without weight sharing."""
  return jnp.sum(delta[:, :, 0] ** 2, axis=0)


def _rows_diag(
  site: _Site, act: Array, rows: Array, shape: tuple, squared: bool
):
  """A dense use's diagonal without weight sharing, ``(a^2)^T sum_s
  delta^2``: one ``(d_in, B)`` matmul serves every sample. ``rows`` are the
  cotangents ``(S, B, O)``, or with ``squared`` their :func:`_summed_sq`.
  The squares (matmul operands, so XLA writes them out) are formed a chunk
  of examples at a time: their memory does not grow with ``B``."""
  a = act[:, 0]
  (b, k), o = a.shape, rows.shape[-1]
  dtype = jnp.promote_types(a.dtype, rows.dtype)

  def part(a_c, r_c):
    return (a_c**2).T @ (r_c if squared else jnp.sum(r_c**2, axis=0))

  total = _sum_over_example_chunks(
    part,
    [a, rows],
    [0, 0 if squared else 1],
    b,
    max(1, _PATCH_CHUNK_ELEMENTS // (k + o * (1 if squared else len(rows)))),
    (k, o),
    dtype,
  )
  return _kernel_to_shape(site, total, shape)


def _diag_stat(site_view, role: str, shape: tuple, chunk_size) -> Array:
  """``sum_{s,n} g_{s,n}^2`` of one use, ``shape``d, from its view."""
  site, act, delta, _ = site_view
  if role == "bias":
    return jnp.sum(jnp.sum(delta, axis=2) ** 2, axis=(0, 1)).reshape(shape)
  if site.kind == "embed":
    ids = act
    same = ids[:, :, None] == ids[:, None, :]  # (B, T, T)
    summed = jnp.einsum("ntu,snud->sntd", same.astype(delta.dtype), delta)
    mult = jnp.sum(same, axis=-1).astype(delta.dtype)  # (B, T)
    per_pos = jnp.sum(summed**2, axis=0) / mult[..., None]
    return (
      jnp.zeros(shape, delta.dtype)
      .at[ids.reshape(-1)]
      .add(per_pos.reshape(-1, shape[-1]))
    )
  if act.shape[1] == 1:
    return _rows_diag(site, act, delta[:, :, 0], shape, squared=False)
  # Weight sharing: no shortcut, per-example products.
  if _loop_over_examples():  # memory O(d_in * d_out), below any chunk
    total = _sum_sq_example_grads(act, delta)
    return _kernel_to_shape(site, total, shape)
  total = sum(
    _chunked_example_sums(act, delta[s], chunk_size)[0]
    for s in range(delta.shape[0])
  )
  return _kernel_to_shape(site, jnp.asarray(total), shape)


def _kron_stat(site_view, role: str, batch: int, reduce: bool = False):
  """K-FAC sums ``(A_sum, Gamma_sum)`` of one use from its view (``None``
  if its factors do not fit the leaf's matrix view)."""
  if not _kron_ok(site_view[0], role):
    return None
  if site_view[0].kind == "bdense":  # per head: (H, K, K) and (H, O, O)
    _, act, delta, _ = site_view
    return _heads_kron_a(act, reduce), _heads_kron_gamma(delta, reduce)
  a_sum = _kron_input(site_view, role, batch, reduce)
  return (a_sum, _kron_gamma(site_view[2], reduce))


def _kron_input(site_view, role: str, batch: int, reduce: bool) -> Array:
  """K-FAC's ``A_sum`` of one use from its view: the activations alone (the
  view's ``delta`` gives only its shape and dtype)."""
  site, act, delta, valid = site_view
  t = delta.shape[2]
  if role == "bias":
    return jnp.full((1, 1), batch, delta.dtype)
  if site.kind == "embed":
    if reduce:  # abar_n: row counts of example n over T
      b = batch
      rows = jnp.arange(b)[:, None]
      counts = (
        jnp.zeros((b, site.num_rows), delta.dtype)
        .at[rows, act]
        .add(valid.astype(delta.dtype))
      ) / t
      return counts.T @ counts
    counts = (
      jnp.zeros((site.num_rows,), delta.dtype)
      .at[act.reshape(-1)]
      .add(valid.reshape(-1).astype(delta.dtype))
    )
    return jnp.diag(counts) / t
  return _kron_a(act, reduce)


def _kron_gamma(delta: Array, reduce: bool) -> Array:
  """``Gamma_sum`` of a view's ``delta`` ``(S, B, T, O)``."""
  if reduce:  # sum over positions first
    summed = jnp.sum(delta, axis=2)
    return jnp.einsum("snd,sne->de", summed, summed)
  return jnp.einsum("sntd,snte->de", delta, delta)  # positions as examples


def _heads_kron_a(act: Array, reduce: bool) -> Array:
  """``A_sum`` per head ``(H, K, K)`` of a per-head view's ``act``
  ``(B, H, T, K)``."""
  return jax.vmap(lambda a: _kron_a(a, reduce), in_axes=1)(act)


def _heads_kron_gamma(delta: Array, reduce: bool) -> Array:
  """``Gamma_sum`` per head ``(H, O, O)`` of a per-head view's ``delta``
  ``(S, B, H, T, O)``."""
  return jax.vmap(lambda d: _kron_gamma(d, reduce), in_axes=2)(delta)


def _kron_a(act: Array, reduce: bool) -> Array:
  """``A_sum`` of a dense view's ``act`` ``(B, T, K)``."""
  if reduce:
    mean = jnp.mean(act, axis=1)
    return mean.T @ mean
  return jnp.einsum("ntd,nte->de", act, act) / act.shape[1]


def _conv_diag(
  eqn,
  x: Array,
  delta: Array,
  shape: tuple,
  chunk_size: int | None,
  with_sum: bool = False,
) -> Array:
  """``sum_{s,n} g_{s,n}^2`` of a conv kernel from its input ``x`` and
  output cotangents ``delta`` ``(S, ...)``, the per-example gradients
  formed for a chunk of examples at a time (``chunk_size``, or as many as
  keep their input patches in cache). ``with_sum`` (one sample): stacked
  with ``sum_n g_n``, the kernel's cotangent, ``(2, *shape)``."""
  num_s, b = delta.shape[:2]
  chunk = _patch_chunk(eqn, chunk_size)

  def square(xc, dc):
    if with_sum:
      g = _conv_kernel_grads(eqn, xc, dc[0])
      return jnp.stack([jnp.sum(g**2, axis=0), jnp.sum(g, axis=0)])
    squares = [
      jnp.sum(_conv_kernel_grads(eqn, xc, dc[s]) ** 2, axis=0)
      for s in range(num_s)
    ]
    return functools.reduce(jnp.add, squares)

  assert not with_sum or num_s == 1
  dtype = jnp.promote_types(x.dtype, delta.dtype)
  shape = (2, *shape) if with_sum else shape
  return _sum_over_example_chunks(
    square, [x, delta], [0, 1], b, chunk, shape, dtype
  )


def _conv_example_grads(
  eqn, x: Array, delta: Array, chunk_size: int | None
) -> Array:
  """Per-example kernel gradients ``(B, *kernel)`` of a conv from its input
  ``x`` and output cotangents ``delta`` (one sample), formed a chunk of
  examples at a time (``chunk_size``, or as many as keep their input
  patches in cache)."""
  chunk = _patch_chunk(eqn, chunk_size)
  one = lambda xc, dc: _conv_kernel_grads(eqn, xc, dc)
  return _chunk_map(one, [x, delta], chunk)


def _conv_stat(
  eqn,
  x: Array,
  delta: Array,
  shape: tuple,
  statistic: str,
  chunk_size: int | None,
  weights: Array | None = None,
) -> Array:
  """``"diag"`` (any samples), ``"gram"`` or ``"combine"`` (one sample) of a
  conv kernel from its input ``x`` and output cotangents ``delta`` ``(S,
  ...)``, the per-example gradients formed a chunk of examples at a time
  from slices of the arrays as recorded."""
  if statistic == "diag":
    return _conv_diag(eqn, x, delta, shape, chunk_size)
  if statistic == "gram":
    g = _conv_example_grads(eqn, x, delta[0], chunk_size)
    g = g.reshape(g.shape[0], -1)
    return g @ g.T
  assert weights is not None
  return _conv_combine(eqn, x, delta[0], weights, shape, chunk_size)


def _conv_gram_fits(view, chunk_size: int | None) -> bool:
  """Whether a conv view's per-example kernel gradients (one sample) are
  formed at once for their Gram matrix: without a ``chunk_size``, when they
  fit the default budget (else the Gram matrix pairs chunks)."""
  site, _, delta = view
  kernel = math.prod(site.eqn.invars[1].aval.shape)
  return (
    chunk_size is None
    and delta.shape[0] == 1
    and delta.shape[1] * kernel <= DEFAULT_CHUNK_ELEMENTS
  )


def _conv_combine(
  eqn,
  x: Array,
  delta: Array,
  weights: Array,
  shape: tuple,
  chunk_size: int | None,
) -> Array:
  """``sum_n weights[:, n] g_n`` ``(k, *kernel)`` of a conv kernel from its
  input ``x`` and output cotangents ``delta`` (one sample), the per-example
  gradients formed a chunk of examples at a time."""
  b = weights.shape[-1]
  chunk = _patch_chunk(eqn, chunk_size)
  dtype = jnp.promote_types(
    weights.dtype, jnp.promote_types(x.dtype, delta.dtype)
  )

  def part(w_c, x_c, d_c):
    return jnp.tensordot(w_c, _conv_kernel_grads(eqn, x_c, d_c), 1)

  return _sum_over_example_chunks(
    part,
    [weights, x, delta],
    [1, 0, 0],
    b,
    chunk,
    (weights.shape[0],) + shape,
    dtype,
  )


def _conv_kron_sums(
  eqn, x: Array, delta: Array, b: int, reduce: bool
) -> tuple[Array, Array]:
  """K-FAC sums ``(A_sum, Gamma_sum)`` of a conv kernel from its input ``x``
  and output cotangents ``delta`` ``(S, ...)``, each as laid out: ``A``
  from the input patches, ``Gamma`` from ``delta`` over positions.

  All B examples' patches at once would grow with B without bound (``B x
  positions x window x channels``): ``A`` sums them a chunk of examples at
  a time.
  """
  return _conv_kron_input(eqn, x, b, reduce), _conv_kron_gamma(
    eqn, delta, b, reduce
  )


def _conv_kron_input(eqn, x: Array, b: int, reduce: bool) -> Array:
  """A conv kernel's K-FAC ``A_sum`` from its input patches."""
  dn = eqn.params["dimension_numbers"]
  x = numerics.widen(x)
  k = math.prod(eqn.invars[1].aval.shape[i] for i in dn.rhs_spec[2:])
  k *= x.shape[dn.lhs_spec[1]]

  def a_sum(xc):  # zero examples have zero patches
    act = _conv_patches(eqn, xc)
    return _kron_a(act.reshape(act.shape[0], -1, k), reduce)

  chunk = _BLOCK_ELEMENTS // _patch_elements(eqn)
  return _sum_over_example_chunks(
    a_sum, [x], [dn.lhs_spec[0]], b, chunk, (k, k), x.dtype
  )


def _conv_kron_gamma(eqn, delta: Array, b: int, reduce: bool) -> Array:
  """A conv kernel's K-FAC ``Gamma_sum`` from its output cotangents ``(S,
  ...)`` over the output positions."""
  dn = eqn.params["dimension_numbers"]
  delta = jnp.moveaxis(numerics.widen(delta), 1 + dn.out_spec[1], -1)
  delta = delta.reshape(delta.shape[0], b, -1, delta.shape[-1])
  return _kron_gamma(delta, reduce)


class LayerGrads:
  """Per-example layer cotangents ``delta`` of a :class:`LayerTape`.

  ``num_samples`` is ``S``; rows are ordered ``i = s * B + n``.
  """

  def __init__(
    self,
    tape: LayerTape,
    deltas: tuple | None,
    num_samples: int,
    *,
    cotangents: PyTree = None,
    columns: Callable[[Array, int], PyTree] | None = None,
  ):
    self._tape = tape
    self._held = deltas
    self._cotangents = cotangents  # (S, ...) not yet pulled back
    self._columns = columns  # (start, n) -> cotangents[start : start + n]
    self.num_samples = num_samples

  @property
  def _deltas(self) -> tuple:
    if self._held is None:
      self._held = self._tape._pull(self._cotangents)
    return self._held

  @property
  def tape(self) -> LayerTape:
    """The recorded forward pass these cotangents were pulled back on."""
    return self._tape

  def take(self, samples: slice) -> LayerGrads:
    """Restricts to a slice of the ``S`` sample axis."""
    deltas = jax.tree.map(lambda d: d[samples], self._deltas)
    num = len(range(*samples.indices(self.num_samples)))
    return LayerGrads(self._tape, deltas, num)

  def _site(self, s: int):
    return _site_view(
      self._tape._plan.sites[s],
      self._tape._acts[s],
      self._deltas[s],
      self._tape.batch,
    )

  def _leaf_items(self):
    """Yields (leaf index, site index, role) for covered leaves with one use
    and no scan slicing them (the others are ``_special``)."""
    special = self._tape._plan.special
    fusion = self._tape._fusion
    fused = fusion.leaves if fusion is not None else {}
    for leaf, r in enumerate(self._tape._plan.roles):
      if r is not None and leaf not in special and leaf not in fused:
        yield leaf, r[0], r[1]

  def _unflatten(self, values: dict) -> PyTree:
    vals = [values.get(i) for i in range(len(self._tape._leaves))]
    return jax.tree_util.tree_unflatten(self._tape._treedef, vals)

  def _fused(self) -> dict:
    """The statistics formed in the backward pass, summed over samples
    (with K-FAC's ``A_sum``, formed in the forward pass)."""
    fusion, out = self._tape._fusion, {}
    if fusion is None:
      return out
    sites, leaves = self._tape._plan.sites, fusion.statistic_leaves
    if fusion.statistic == "gram":  # the shared tap's: (S = 1, B, B)
      return {min(leaves): self._deltas[-1][0]} if leaves else {}
    for leaf, (s, _) in leaves.items():
      val = self._deltas[s].get(leaf)
      if fusion.statistic == "kron" and sites[s].kind in _ELEMENTWISE:
        val = None  # per-example gradients (example_grads), not factors
      if val is None:  # no K-FAC factors for this leaf
        out[leaf] = None
      elif fusion.statistic == "diag":
        out[leaf] = jnp.sum(val, axis=0)
      elif fusion.statistic == "combine":  # (S = 1, *L, k, *shape)
        out[leaf] = jnp.moveaxis(
          val[1][0], self._tape._plan.layer_axes(leaf), 0
        )
      else:  # Gamma per sample; A_sum from the forward pass
        out[leaf] = (self._tape._acts[s][leaf], jnp.sum(val, axis=0))
    return out

  def _fused_grads(self) -> dict[int, Array]:
    """Leaf -> the per-example gradients ``(S * B, *leaf)`` the backward
    pass formed (:func:`record`'s ``ordered`` with ``"gram"``)."""
    fusion = self._tape._fusion
    if fusion is None:
      return {}
    out = {}
    for leaf in sorted(fusion.grads):
      g = self._deltas[fusion.leaves[leaf][0]][leaf]  # (S, *L, B, *per)
      g = jnp.moveaxis(g, 1 + self._tape._plan.layer_axes(leaf), 1)
      out[leaf] = g.reshape((-1,) + self._leaf_shape(leaf))
    return out

  def example_grads(self) -> PyTree:
    """Per-example gradients of the elementwise leaves, cheap to form.

    A covered leaf whose every use is an elementwise scale or shift (norm
    scales and biases, learned positions; stacked or shared too) has small
    per-example gradients, ``x * delta`` or ``delta`` summed over the
    broadcast positions: returned as ``(S * B, *leaf)``, rows ``s * B + n``.
    They give such a leaf the Shampoo-style factors K-FAC lacks without a
    per-example backward pass. A tape recorded with ``statistic="diag"``
    does not keep them for its fused leaves.

    Returns:
      A params-shaped tree, ``None`` at the other leaves.
    """
    return self._unflatten(self._example_grads())

  def _example_grads(self) -> dict:
    plan, fusion = self._tape._plan, self._tape._fusion
    num_s, b = self.num_samples, self._tape.batch
    out: dict[int, Any] = {}
    for leaf, r in enumerate(plan.roles):
      if r is None or not _elementwise(plan, leaf):
        continue
      shape = self._leaf_shape(leaf)
      if fusion is not None and leaf in fusion.leaves:
        if fusion.statistic != "kron":
          continue
        g = self._deltas[r[0]][leaf]  # (S, *L, B, *per)
        g = jnp.moveaxis(g, 1 + plan.layer_axes(leaf), 1)  # (S, B, *L, *per)
      elif leaf in plan.special:
        rows = jnp.arange(num_s * b)
        g = sum(
          self._use_grads(v, role, (leaf,), x, rows)[0]
          for v, role, x in self._special_views(leaf)
        )
      else:
        delta = self._view(r[0])[2]  # (S, B, R, P), iterations in R
        g = jnp.sum(delta, axis=2)
      out[leaf] = jnp.asarray(g).reshape((num_s * b,) + shape)
    return out

  def _one_stat(self, structure, view, role, leaf, chunk_size, reduce):
    if structure == "diag":
      return _diag_stat(view, role, self._leaf_shape(leaf), chunk_size)
    return _kron_stat(view, role, self._tape.batch, reduce)

  def _leaf_shape(self, leaf: int, sliced: int = 0) -> tuple[int, ...]:
    """A leaf's shape without its ``sliced`` leading (layer) axes."""
    return tuple(np.shape(self._tape._leaves[leaf]))[sliced:]

  def statistics(
    self,
    structure: str,
    *,
    chunk_size: int | None = None,
    weight_sharing: str = "expand",
  ) -> PyTree:
    """Sums of per-example statistics over samples and examples.

    For sample ``s`` and example ``n`` the pseudo-gradient is
    :math:`g_{s,n} = J_n^\\top r_{s,n}`. For every covered leaf, without
    forming any ``g``: ``"diag"`` gives :math:`\\sum_{s,n} g_{s,n}^2` (leaf
    shaped); ``"kron"`` the K-FAC sums ``(A_sum, Gamma_sum)``: for a kernel
    ``A_sum = sum_n mean_t a a^T`` (``(d_in, d_in)``; an embedding's is the
    diagonal of row counts) and ``Gamma_sum = sum_{s,n,t} delta delta^T``,
    for a bias ``A_sum = [[B]]``; ``"gram"`` one ``(S * B, S * B)`` array
    :math:`\\sum_{\\text{covered}} \\langle g_i, g_j \\rangle`. A leaf
    stacked along a scan has ``"kron"`` factors per layer (``(L, K, K)``,
    ``(L, O, O)``); one with several uses, or an elementwise one, has none
    (``None``; see :meth:`example_grads`). On a tape recorded with a
    ``statistic``, only that structure is served. ``weight_sharing="reduce"`` sums over the positions
    first (Eschenhagen et al, 2023): ``A_sum = sum_n abar_n abar_n^T`` with
    ``abar_n = mean_t a_t`` and ``Gamma_sum = sum_{s,n} (sum_t delta)
    (sum_t delta)^T``; both conventions agree when ``T = 1``.

    Args:
      structure: ``"diag"``, ``"kron"`` or ``"gram"``.
      chunk_size: examples per chunk where per-example layer gradients must
        be formed (weight-shared diagonal, shared leaves; rows ``s * B + n``
        for those); ``None`` picks a chunk of about ``2**24`` elements. For
        ``"diag"`` of ``S > 1`` cotangents from :meth:`LayerTape.backward`,
        also the rows per backward pass: ``max(1, chunk_size // B)`` samples
        at a time (one without it), so memory does not grow with ``S``; the
        same for ``"kron"`` (:meth:`kron_and_example_grads`).
      weight_sharing: ``"expand"`` (positions as extra examples) or
        ``"reduce"`` (positions summed first), for ``"kron"`` only.

    Returns:
      A params-shaped tree with ``None`` at uncovered leaves, or the Gram
      matrix. Float32 or wider.
    """
    validation.check_choice("structure", structure, STRUCTURES)
    validation.check_choice("weight_sharing", weight_sharing, WEIGHT_SHARING)
    self._check_fusion(structure, weight_sharing)
    if structure == "diag":
      return self._unflatten(self._diag_sums(chunk_size))
    if structure == "kron":
      return self._kron(chunk_size, weight_sharing, with_grads=False)[0]
    views = self._views()
    n = self.num_samples * self._tape.batch
    # Summed from the first term, not from zeros: XLA:CPU allocated a zero
    # (n, n) at the program's start, live through the forward pass.
    terms: list[Array] = []
    rows: dict[int, list[str]] = {}  # site -> roles with a row-form Gram
    for _, s, role in self._leaf_items():
      if _row_gram_ok(views(s), role):
        rows.setdefault(s, []).append(role)
      else:
        terms.append(_gram_stat(views(s), role, chunk_size))
    if rows:
      parts = [_row_gram_term(views(s), r) for s, r in rows.items()]
      terms.append(_rows_gram(parts, n, self._tape.batch))
    terms += self._special(structure, chunk_size).values()
    terms += self._fused().values()
    grads = self._fused_grads()
    if grads:  # one (n, sum P) matrix, one product
      g = jnp.concatenate([v.reshape(n, -1) for v in grads.values()], axis=1)
      terms.append(g @ g.T)
    if not terms:
      return jnp.zeros((n, n), jnp.float32)
    total = functools.reduce(jnp.add, terms)
    return total.astype(jnp.promote_types(total.dtype, jnp.float32))

  def _views(self) -> Callable[[int], tuple]:
    """:meth:`_view` of a site, formed once for the leaves that share it."""
    cache: dict = {}

    def view(s: int) -> tuple:
      if s not in cache:
        cache[s] = self._view(s)
      return cache[s]

    return view

  def _check_fusion(self, structure: str, weight_sharing: str) -> None:
    fusion = self._tape._fusion
    if fusion is not None and (
      structure != fusion.statistic
      or (structure == "kron" and weight_sharing != fusion.weight_sharing)
    ):
      raise ValueError(
        "this tape forms the statistic of its scanned layers in the backward "
        f"pass: record(statistic={fusion.statistic!r}, weight_sharing="
        f"{fusion.weight_sharing!r}); it cannot give {structure!r} with "
        f"weight_sharing={weight_sharing!r}. Record with statistic=None "
        "(every layer's activations and cotangents) for other statistics."
      )

  # -- the diagonal, a few samples at a time ----------------------------------

  def _summed_rows(self, s: int, role: str) -> bool:
    """Whether a use's diagonal sums ``delta^2`` over the samples first: a
    dense kernel without weight sharing (one ``(d_in, B)`` matmul then
    serves every sample)."""
    site = self._tape._plan.sites[s]
    if site.kind != "dense" or role == "bias":
      return False
    if s in self._tape._plan.site_loops:
      return False
    act = self._tape._acts[s]
    return _dense_act(site, act, self._tape.batch).shape[1] == 1

  def _diag_parts(self, chunk_size, summed: bool = True) -> dict:
    """Per covered leaf, a sum over this object's samples that
    :meth:`_diag_finish` turns into its diagonal: the diagonal sums
    themselves, or where :meth:`_summed_rows` ``sum_s delta^2`` ``(B, O)``
    (without ``summed``, the ``(S, B, O)`` cotangents, squared later a
    chunk of examples at a time)."""
    out, views = {}, self._views()
    for leaf, s, role in self._leaf_items():
      if self._summed_rows(s, role):
        delta = self._site(s)[2]
        out[leaf] = _summed_sq(delta) if summed else delta[:, :, 0]
      else:
        shape = self._leaf_shape(leaf)
        out[leaf] = _diag_stat(views(s), role, shape, chunk_size)
    out.update(self._special("diag", chunk_size))
    out.update(self._fused())
    return out

  def _diag_finish(self, parts: dict, summed: bool) -> dict:
    out = dict(parts)
    for leaf, s, role in self._leaf_items():
      if self._summed_rows(s, role):
        site = self._tape._plan.sites[s]
        act = _dense_act(site, self._tape._acts[s], self._tape.batch)
        shape = self._leaf_shape(leaf)
        out[leaf] = _rows_diag(site, act, parts[leaf], shape, summed)
    return out

  def _diag_sums(self, chunk_size) -> dict:
    """The diagonal of every covered leaf: :meth:`_diag_parts` over all
    samples, a few per backward pass (:meth:`_over_samples`)."""
    if self._per_pass(chunk_size) is None:
      return self._diag_finish(self._diag_parts(chunk_size, False), False)
    parts = lambda g: (g._diag_parts(chunk_size), {})
    return self._diag_finish(self._over_samples(chunk_size, parts)[0], True)

  def _kron_parts(self, chunk_size, reduce: bool) -> dict:
    """Leaf -> K-FAC sums ``(A_sum, Gamma_sum)`` (``None`` without)."""
    views = self._views()
    out = {
      leaf: self._one_stat("kron", views(s), role, leaf, chunk_size, reduce)
      for leaf, s, role in self._leaf_items()
    }
    out.update(self._special("kron", chunk_size, reduce=reduce))
    out.update(self._fused())
    return out

  def kron_and_example_grads(
    self,
    *,
    chunk_size: int | None = None,
    weight_sharing: str = "expand",
    reduce_rows: Callable[[dict], dict] | None = None,
  ) -> tuple[PyTree, PyTree]:
    """``(statistics("kron"), example_grads())`` from the same backward
    passes.

    Cotangents not yet pulled back go through the backward pass ``max(1,
    chunk_size // B)`` samples at a time (one without ``chunk_size``; a
    scan), as for the diagonal: the ``delta`` of ``S`` samples are never
    held at once. The ``A`` factors come from the activations once (on a
    tape recorded with ``statistic="kron"``, those of its fused layers in
    the forward pass).

    ``reduce_rows`` (``{leaf: rows} -> {leaf: sums}``, sums that add over
    rows, such as Shampoo's ``sum G G^T``) replaces the example gradients
    by their sums, formed a backward pass at a time: the ``S * B`` rows are
    never held at once.
    """
    validation.check_choice("weight_sharing", weight_sharing, WEIGHT_SHARING)
    self._check_fusion("kron", weight_sharing)
    return self._kron(chunk_size, weight_sharing, True, reduce_rows)

  def _kron(
    self,
    chunk_size,
    weight_sharing: str,
    with_grads: bool,
    reduce_rows: Callable[[dict], dict] | None = None,
  ) -> tuple[PyTree, PyTree]:
    """:meth:`kron_and_example_grads` after its checks; ``None`` grads
    without ``with_grads``."""
    reduce = weight_sharing == "reduce"
    grads = (lambda g: g._example_grads()) if with_grads else (lambda g: {})
    if reduce_rows is not None:
      grads = lambda g, rows_of=grads: reduce_rows(rows_of(g))
    if self._per_pass(chunk_size) is None:
      kron, rows = self._kron_parts(chunk_size, reduce), grads(self)
    else:
      pair = lambda v: isinstance(v, tuple)

      def parts(g):  # Gamma (and reduced rows) sum over the samples
        kron = g._kron_parts(chunk_size, reduce)
        gammas = {k: v[1] for k, v in kron.items() if pair(v)}
        if reduce_rows is not None:
          return (gammas, grads(g)), {}
        return (gammas, {}), grads(g)

      (gammas, sums), rows = self._over_samples(chunk_size, parts)
      if reduce_rows is not None:
        rows = sums
      # A does not depend on the samples: once, from the activations (or
      # the fused layers' forward pass). The Gamma of these zero cotangents
      # is never used, so XLA drops it.
      once = self._zero_deltas()._kron_parts(chunk_size, reduce)
      kron = {k: (once[k][0], v) for k, v in gammas.items()}
    return self._unflatten(kron), self._unflatten(rows) if with_grads else None

  def _zero_deltas(self) -> LayerGrads:
    """One sample of zero cotangents, never pulled back: statistics that
    read only the activations (K-FAC's ``A``) without a backward pass."""
    one = jax.tree.map(lambda c: c[:1], self._cotangents)
    shapes = jax.eval_shape(self._tape._pull, one)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return LayerGrads(self._tape, zeros, 1)

  def _per_pass(self, chunk_size) -> int | None:
    """Samples per backward pass, or ``None`` for one pass of all (held
    ``delta``, or no more samples than one pass takes)."""
    per_pass = max(1, (chunk_size or 0) // self._tape.batch)
    if self._held is not None or self.num_samples <= per_pass:
      return None
    return per_pass

  def _over_samples(self, chunk_size, parts: Callable) -> tuple:
    """``parts(grads) -> (sums, rows)`` over the samples, the cotangents
    pulled back ``per_pass`` at a time in a scan: the pass holds the
    ``delta`` of those samples, not ``S``, and its memory stays near the
    batch gradient's at any ``B``. ``sums`` are added over the passes and
    ``rows`` (``(per_pass * B, ...)``, rows ``s * B + n``) stacked to ``S *
    B`` rows."""
    per_pass = self._per_pass(chunk_size)
    assert per_pass is not None
    num, b, tape = self.num_samples, self._tape.batch, self._tape
    passes = -(-num // per_pass)
    pad = passes * per_pass - num

    def group(c):  # zero cotangents add zero to every sum over samples
      if pad:
        c = jnp.concatenate([c, jnp.zeros((pad,) + c.shape[1:], c.dtype)])
      return c.reshape((passes, per_pass) + c.shape[1:])

    columns = self._columns
    if columns is None:
      xs = jax.tree.map(group, self._cotangents)
      cotangents = lambda c: c
    else:  # each pass forms its own samples' cotangents
      xs = jnp.arange(passes) * per_pass
      cotangents = lambda start: columns(start, per_pass)
    one = lambda c: parts(LayerGrads(tape, tape._pull(cotangents(c)), per_pass))

    def body(acc, c):
      sums, rows = one(c)
      return jax.tree.map(jnp.add, acc, sums), rows

    shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], xs))
    init = jax.tree.map(
      lambda a: _zeros_varying(a.shape, a.dtype, a), shapes[0]
    )
    sums, rows = lax.scan(body, init, xs)
    rows = jax.tree.map(
      lambda r: r.reshape((-1,) + r.shape[2:])[: num * b], rows
    )
    return sums, rows

  def combine(self, weights: Array) -> PyTree:
    """Weighted sums of pseudo-gradients, ``sum_i weights[:, i] g_i``.

    On a tape recorded with ``statistic="combine"``, the scanned layers'
    sums were formed in the backward pass with the recorded weights:
    ``weights`` must be that same array.

    Args:
      weights: ``(k, S * B)``, columns ordered ``i = s * B + n``.

    Returns:
      A params-shaped tree, each covered leaf with a leading ``k`` axis,
      ``None`` elsewhere.
    """
    fusion = self._tape._fusion if self._tape.fused else None
    if fusion is not None and fusion.statistic != "combine":
      raise ValueError(
        "combine needs every layer's activations and cotangents; this tape "
        "forms its scanned layers' statistic in the backward pass (record "
        "with statistic=None, or with statistic='combine' and the weights)."
      )
    if fusion is not None and weights is not fusion.weights:
      raise ValueError(
        "this tape formed its scanned layers' weighted sums in the backward "
        "pass with the weights it was recorded with "
        "(record(statistic='combine', weights=...)); pass the same array."
      )
    num_s, b = self.num_samples, self._tape.batch
    weights = jnp.asarray(weights)
    if weights.ndim != 2 or weights.shape[1] != num_s * b:
      raise ValueError(
        f"weights must have shape (k, S * B) = (k, {num_s * b}); got "
        f"{tuple(weights.shape)}."
      )
    out = {}
    for leaf, s, role in self._leaf_items():
      shape = self._leaf_shape(leaf)
      out[leaf] = _combine_stat(self._view(s), role, weights, shape)
    out.update(self._special_combine(weights))
    out.update(self._fused())
    for leaf, g in self._fused_grads().items():
      w = numerics.widen(weights).astype(
        jnp.promote_types(weights.dtype, g.dtype)
      )
      out[leaf] = jnp.tensordot(w, g, 1)
    return self._unflatten(out)

  # -- sites inside scans, and leaves with several uses ----------------------

  def _view(self, s: int) -> tuple[Any, Any, Any, Any]:
    """``_site(s)``, with a scan's iterations folded into the positions."""
    if s not in self._tape._plan.site_loops:
      return self._site(s)
    site, act, delta, valid = self._loop_view(s, None)
    return site, _first(act), delta[0], _first(valid)

  def _loop_view(
    self, s: int, modes: tuple[str, ...] | None
  ) -> tuple[Any, Any, Any, Any]:
    """The view of a site for a use whose leaf enters the scans around it
    as ``modes`` (``None``: all shared).

    Returns ``(site, act, delta, valid)`` like ``_site`` with a leading axis
    ``X`` over the iterations of the scans that slice the leaf (``"xs"``,
    ``X = 1`` if none); the iterations of the scans that share it
    (``"const"``) become positions, like a weight shared over positions. A
    conv keeps its own layout: its shared iterations join ``X`` (after the
    sliced ones), and :meth:`_use_grads` adds them up per example.
    """
    lengths = self._tape._plan.site_loops.get(s, ())
    if not lengths:
      site, act, delta, valid = self._site(s)
      lift = lambda x: None if x is None else x[None]
      return site, lift(act), delta[None], lift(valid)
    n = len(lengths)
    modes = modes or ("const",) * n
    site = self._tape._plan.sites[s]
    act = self._tape._acts[s]
    act = act.reshape((-1,) + act.shape[n:])
    delta = jnp.moveaxis(self._deltas[s], 0, n)
    delta = delta.reshape((-1,) + delta.shape[n:])

    def one(a, d):  # the view of one iteration
      tape = dataclasses.replace(self._tape, _acts=_put(self._tape._acts, s, a))
      grads = LayerGrads(tape, _put(self._deltas, s, d), self.num_samples)
      return grads._site(s)[1:]

    sliced = [i for i, m in enumerate(modes) if m == "xs"]
    shared = [i for i, m in enumerate(modes) if m != "xs"]

    def fold(x, pre):  # (L..., *pre, B, T, ...) -> (X, *pre, B, L_c * T, ...)
      if x is None:
        return None
      x = x.reshape(tuple(lengths) + x.shape[1:])
      mid = list(range(n, n + pre + 1))
      if site.kind in _CHUNKED:  # -> (X * L_c, *pre, B, ...)
        x = jnp.transpose(x, sliced + shared + list(range(n, x.ndim)))
        return x.reshape((-1,) + x.shape[n:])
      x = jnp.transpose(
        x, sliced + mid + shared + list(range(n + pre + 1, x.ndim))
      )
      rest = x.shape[len(sliced) :]
      pos = math.prod(rest[pre + 1 : pre + 2 + len(shared)])
      return x.reshape(
        (-1,) + rest[: pre + 1] + (pos,) + rest[pre + 2 + len(shared) :]
      )

    act, delta, valid = jax.vmap(one)(act, delta)
    return site, fold(act, 0), fold(delta, 1), fold(valid, 0)

  def _special_views(self, leaf: int) -> list:
    return [
      (self._loop_view(s, modes), role, modes.count("xs"))
      for s, role, modes in self._tape._plan.special[leaf]
    ]

  def _conv_kron(self, leaf: int, reduce: bool):
    """K-FAC factors of a conv kernel with one use outside scans (else
    ``None``; a stacked one, and per-head kernels: :meth:`_stacked_kron`)."""
    uses = self._tape._plan.special[leaf]
    if len(uses) != 1 or uses[0][2]:
      return None
    s = uses[0][0]
    site = self._tape._plan.sites[s]
    if site.kind != "conv" or not _kron_ok(site, uses[0][1]):
      return None
    return _conv_kron_sums(
      site.eqn, self._tape._acts[s], self._deltas[s], self._tape.batch, reduce
    )

  def _stacked_kron(self, leaf: int, reduce: bool):
    """K-FAC factors of each layer of a leaf stacked along a scan with one
    use in its body, ``(*L, K, K)`` and ``(*L, O, O)`` (else ``None``); a
    per-head kernel's per layer and head, ``(*L, *H, K, K)``, also outside
    scans (``L = ()``)."""
    uses = self._tape._plan.special[leaf]
    heads = self._tape._plan.sites[uses[0][0]].kind == "bdense"
    if len(uses) != 1 or ("xs" not in uses[0][2] and not heads):
      return None
    ((site, *arrays), role, sliced) = self._special_views(leaf)[0]
    if not _kron_ok(site, role):
      return None
    if site.kind in _CHUNKED and not _stacked_only(uses[0][2]):
      return None  # their shared iterations are not positions (_loop_view)
    b = self._tape.batch
    if site.kind == "conv":
      one = lambda a: _conv_kron_sums(site.eqn, a[0], a[1], b, reduce)
    else:
      one = lambda a: _kron_stat((site, *a), role, b, reduce)
    a_sum, gamma = lax.map(one, tuple(arrays))
    heads = site.heads if site.kind == "bdense" else 0  # per layer and head
    lead = tuple(np.shape(self._tape._leaves[leaf]))[: sliced + heads]
    return (
      a_sum.reshape(lead + a_sum.shape[-2:]),
      gamma.reshape(lead + gamma.shape[-2:]),
    )

  def _special(self, structure: str, chunk_size, **kwargs) -> dict:
    """Statistics of leaves sliced by scans or with several uses.

    A leaf stacked along a scan's iterations with one use in the body: the
    usual statistics of each iteration's slice (``lax.map`` over the
    layers; the Gram matrix is their sum). A shared leaf: per-example
    gradients summed over its uses, formed for a chunk of examples at a
    time. A stacked leaf has K-FAC factors per layer; a shared one none.
    """
    out: dict = {}
    for leaves in self._special_groups():
      if structure == "kron":
        reduce = kwargs.get("reduce", False)
        for leaf in leaves:
          out[leaf] = self._conv_kron(leaf, reduce)
          if out[leaf] is None:
            out[leaf] = self._stacked_kron(leaf, reduce)
        continue
      leaf = leaves[0]
      conv = self._plain_conv(leaves)
      if conv is not None and (
        structure == "diag" or _conv_gram_fits(conv, chunk_size)
      ):
        site, act, delta = conv
        shape = self._leaf_shape(leaf)
        out[leaf] = _conv_stat(
          site.eqn, act, delta, shape, structure, chunk_size
        )
        continue
      views = self._special_views(leaf)
      if (
        len(views) > 1
        or views[0][0][0].kind in _CHUNKED
        or views[0][1] == "derived"
      ):
        out.update(self._shared(views, leaves, structure, chunk_size))
        continue
      ((site, *arrays), role, sliced) = views[0]
      per = self._leaf_shape(leaf, sliced)
      if structure == "diag":
        val = lax.map(
          lambda a: _diag_stat((site, *a), role, per, chunk_size),
          tuple(arrays),
        )
        out[leaf] = val.reshape(np.shape(self._tape._leaves[leaf]))
      else:
        val = lax.map(
          lambda a: _gram_stat((site, *a), role, chunk_size), tuple(arrays)
        )
        out[leaf] = jnp.sum(val, axis=0)
    return out

  def _plain_conv(self, leaves: tuple[int, ...]):
    """The view of a conv kernel's one use outside scans (else ``None``),
    activations as the forward pass laid them out.

    Its statistics then slice examples from the recorded arrays in place: a
    view lifted to the scans' ``(X, ...)`` layout made XLA:CPU copy the
    activation (the copy fuses with its producer, so the forward pass's
    buffer is not reused), one activation more than the gradient holds.
    """
    uses = self._tape._plan.special[leaves[0]]
    if len(leaves) != 1 or len(uses) != 1:
      return None
    s, role, modes = uses[0]
    if modes or role != "kernel" or self._tape._plan.sites[s].kind != "conv":
      return None
    site, act, delta, _ = self._site(s)
    assert act is not None
    return site, act, delta

  def _special_groups(self) -> list[tuple[int, ...]]:
    """The special leaves (not fused), grouped: leaves used only through
    the same derived values of convolutions or per-head kernels (a
    WeightNorm conv's direction and scale) form their per-example gradients
    together, the value's once and one VJP for all. A dense layer's
    per-example gradient is an outer product that XLA fuses into each
    leaf's VJP: there the joint VJP measured slower on XLA:CPU (a
    WeightNorm MLP's exact diagonal 10%), a conv's 17-32% faster."""
    groups: dict[Any, list[int]] = {}
    plan, fusion = self._tape._plan, self._tape._fusion
    for leaf, uses in plan.special.items():
      if fusion is not None and leaf in fusion.leaves:
        continue
      joint = all(
        role == "derived" and plan.sites[s].kind in _CHUNKED
        for s, role, _ in uses
      )
      groups.setdefault(tuple(uses) if joint else leaf, []).append(leaf)
    return [tuple(g) for g in groups.values()]

  def _operand_shape(
    self, site: _Site, leaf: int, derived: bool
  ) -> tuple[int, ...]:
    """The shape of the parameter operand a use's statistic is of: the
    leaf's, or (``derived``) the derived value's (a WeightNorm kernel; a
    bias at its site is a leaf of its own)."""
    if not derived:
      return self._leaf_shape(leaf)
    assert site.derived is not None
    return self._tape._plan.derived[site.derived].shape

  def _derived_vjp(self, site: _Site, leaves: tuple[int, ...]) -> Callable:
    """``G -> (J_k^T G, ...)`` from a site's derived value to leaves it
    depends on."""
    assert site.derived is not None
    value = self._tape._plan.derived[site.derived]
    return value.leaf_vjp(self._tape._derived[site.derived], leaves)

  def _use_grads(
    self, view, role: str, leaves: tuple[int, ...], sliced: int, rows, vjp=None
  ) -> tuple[Array, ...]:
    """Per-example gradients ``(c, *leaf)`` of one use, rows ``s * B + n``,
    for each of ``leaves`` (several only for a derived value's).

    A use of a derived value ``D`` (``role == "derived"``) forms ``D``'s
    per-example gradients, then maps them to the leaves' by the VJP of
    ``D``'s program (in a scan, ``(L, *D)`` and the program per iteration;
    ``vjp``: that map, linearised once outside the caller's loop over
    chunks).
    """
    site = view[0]
    if role != "derived":
      (leaf,) = leaves
      return (self._operand_grads(view, role, leaf, sliced, rows),)
    role = "bias" if site.kind in _ELEMENTWISE else "kernel"
    if vjp is None:
      vjp = self._derived_vjp(site, leaves)
    value = lambda r: self._operand_grads(
      view, role, leaves[0], sliced, r, derived=True
    )
    if _loop_over_examples():
      # One example at a time: XLA:CPU runs batched per-example kernel
      # products several times slower than 2-D ones, and fuses a vmapped
      # VJP's reductions (WeightNorm's norms) into their broadcast
      # consumers, recomputing them per element (3 s against 11 ms for a
      # loop, 32 rows of a (784, 256) kernel).
      return lax.map(lambda r: vjp(value(r[None])[0]), rows)
    return jax.vmap(vjp)(value(rows))

  def _operand_grads(
    self, view, role: str, leaf: int, sliced: int, rows, derived: bool = False
  ):
    """Per-example gradients ``(c, *operand)`` of a use's operand: the
    leaf, or (``derived``) the derived value it is used through."""
    (site, act, delta, _), b = view, self._tape.batch
    shape = self._operand_shape(site, leaf, derived)
    per, c = shape[sliced:], rows.shape[0]
    sample, n = rows // b, rows % b
    layers = math.prod(shape[:sliced])

    def one(a, d):  # one layer's slice of the leaf; (L_c, ...) iterations
      d = d[:, sample, n]  # (L_c, c, T, O)
      if site.kind == "conv":  # L_c >= 1 applications per example
        merge = lambda x: jnp.moveaxis(x, 0, 1).reshape((-1,) + x.shape[2:])
        return _conv_kernel_grads(
          site.eqn, merge(a[:, n]), merge(d), shared=d.shape[0]
        )
      if site.kind == "bdense":  # per head, summed over the iterations
        g = jnp.einsum("lchtk,lchto->chko", a[:, n], d)
        return _kernel_to_shape(site, g.reshape(c, -1, g.shape[-1]), per)
      d = d[0]  # L_c = 1: the other kinds fold shared iterations into T
      if role == "bias":
        return jnp.sum(d, axis=1).reshape((c,) + per)
      a = a[0]
      if site.kind == "embed":
        g = jnp.zeros((c,) + per, d.dtype)
        return g.at[jnp.arange(c)[:, None], a[n]].add(d)
      g = jnp.einsum("cti,ctj->cij", a[n], d)
      return _kernel_to_shape(site, g, per)

    split = lambda x: (
      None if x is None else x.reshape((layers, -1) + x.shape[1:])
    )
    g = jax.vmap(one)(split(act), split(delta))  # (X, c, *per)
    return jnp.moveaxis(g, 0, 1).reshape((c,) + shape)

  def _chunks(
    self, views, leaves: tuple[int, ...], chunk_size, summed: bool = False
  ):
    """``(chunk, count, grads)``: ``grads(j)`` is chunk ``j``'s rows and
    their per-example gradients summed over the uses (padding rows 0), one
    array per leaf of ``leaves`` (a group of :meth:`_special_groups`).

    ``summed``: the caller adds a function of each chunk up (the diagonal,
    weighted sums), so on XLA:CPU a derived value's leaf takes one example
    at a time without a ``chunk_size``: batched per-example kernel products
    run there several times slower than one 2-D product per example (a
    ``(784, 256)`` kernel's diagonal over 32 examples, with its WeightNorm
    VJP: 61 ms in one chunk, 5 ms one at a time).
    """
    shapes = [self._leaf_shape(k) for k in leaves]
    num = self.num_samples * self._tape.batch
    size = max(  # a derived value's gradients may be larger than the leaves'
      math.prod(self._operand_shape(site, leaves[0], role == "derived"))
      for (site, *_), role, _ in views
    )
    patches = sum(  # a use forms its patches of all X iterations at once
      _patch_elements(site.eqn) * act.shape[0]
      for (site, act, *_), _, _ in views
      if site.kind == "conv"
    )
    chunk = chunk_size or max(
      1,
      min(
        # as for one leaf (a group is one large leaf and small ones)
        DEFAULT_CHUNK_ELEMENTS // max(size, *map(math.prod, shapes)),
        _PATCH_CHUNK_ELEMENTS // max(patches, 1),
      ),
    )
    derived = any(role == "derived" for _, role, _ in views)
    if summed and derived and chunk_size is None and _loop_over_examples():
      chunk = 1
    chunk = min(chunk, num)

    # A derived value's program is linearised once, not in every chunk.
    vjps = [
      self._derived_vjp(v[0], leaves) if r == "derived" else None
      for v, r, _ in views
    ]

    def grads(j):
      rows = j * chunk + jnp.arange(chunk)
      keep = rows < num
      rows = jnp.minimum(rows, num - 1)
      uses = [
        self._use_grads(v, r, leaves, x, rows, vjp)
        for (v, r, x), vjp in zip(views, vjps)
      ]
      masked = []
      for g in (jnp.asarray(sum(gs)) for gs in zip(*uses)):
        mask = keep.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
        masked.append(g * mask)
      return rows, tuple(masked)

    return chunk, -(-num // chunk), grads

  def _shared(
    self, views, leaves: tuple[int, ...], structure: str, chunk_size
  ) -> dict:
    """Diagonal or Gram matrix of a leaf with several uses (or of a group
    of leaves, :meth:`_special_groups`), chunked: ``{leaf: diagonal}``, or
    the group's Gram matrix at its first leaf.

    The Gram matrix pairs every two chunks, forming chunk ``i``'s gradients
    again for every chunk ``j``: about ``count`` times the diagonal's work,
    with two chunks of gradients in memory (one product if one chunk holds
    every example, or, without a ``chunk_size``, if every example's
    gradient fits the default budget).
    """
    chunk, count, grads = self._chunks(
      views, leaves, chunk_size, summed=structure == "diag"
    )
    shapes = [self._leaf_shape(k) for k in leaves]
    total = sum(math.prod(shape) for shape in shapes)
    dtype = jnp.result_type(*(v[0][2].dtype for v in views))
    if structure == "diag":
      square = lambda j: tuple(jnp.sum(g**2, axis=0) for g in grads(j)[1])
      diag = _loop_sums(square, count, shapes, dtype, views)
      return dict(zip(leaves, diag))

    num = self.num_samples * self._tape.batch
    rows = lambda j: tuple(g.reshape(chunk, -1) for g in grads(j)[1])
    # the group's Gram matrix: the sum of its leaves' (no concatenated copy)
    prod = lambda x, y: jnp.asarray(sum(a @ b.T for a, b in zip(x, y)))
    if count == 1:
      return {leaves[0]: prod(rows(0), rows(0))}
    fits = count * chunk * total <= DEFAULT_CHUNK_ELEMENTS
    if chunk_size is None and fits:
      # Every example's gradient fits the default budget (the chunks bound
      # a conv's patches): form each chunk once, one product.
      g = lax.map(rows, jnp.arange(count))
      g = tuple(x.reshape(count * chunk, -1) for x in g)
      return {leaves[0]: prod(g, g)[:num, :num]}

    def column(j):  # every chunk i against chunk j
      g_j = rows(j)
      return lax.map(lambda i: prod(rows(i), g_j), jnp.arange(count))

    blocks = lax.map(column, jnp.arange(count))  # (j, i, chunk, chunk)
    gram = jnp.transpose(blocks, (1, 2, 0, 3)).reshape(count * chunk, -1)
    return {leaves[0]: gram[:num, :num]}

  def _special_combine(self, weights: Array) -> dict:
    """``combine`` of the ``_special`` leaves from chunked gradients."""
    out = {}
    for leaves in self._special_groups():
      conv = self._plain_conv(leaves)
      if conv is not None and conv[2].shape[0] == 1:
        site, act, delta = conv
        shape = self._leaf_shape(leaves[0])
        w = numerics.widen(weights)
        stat = _conv_stat(site.eqn, act, delta, shape, "combine", None, w)
        out[leaves[0]] = stat
        continue
      views = self._special_views(leaves[0])
      _, count, grads = self._chunks(views, leaves, None, summed=True)
      dtype = jnp.result_type(*(v[0][2].dtype for v in views))
      w = numerics.widen(weights).astype(
        jnp.promote_types(weights.dtype, dtype)
      )
      shapes = tuple((w.shape[0],) + self._leaf_shape(k) for k in leaves)

      def weighted(j, w=w, grads=grads):
        rows, gs = grads(j)
        return tuple(jnp.tensordot(w[:, rows], g, 1) for g in gs)

      out_dtype = jnp.promote_types(w.dtype, dtype)
      sums = _loop_sums(weighted, count, shapes, out_dtype, [w, views])
      out.update(zip(leaves, sums))
    return out


def _loop_sum(
  fn: Callable[[Array], Array],
  count: int,
  shape,
  dtype,
  like: Any,
  after: bool = True,
) -> Array:
  """``sum_{j < count} fn(j)`` as a ``scan`` (one ``fn(j)`` live at a time),
  the carry varying like ``like`` under ``shard_map``."""
  return _loop_sums(lambda j: (fn(j),), count, (shape,), dtype, like, after)[0]


def _loop_sums(
  fn: Callable[[Array], tuple[Array, ...]],
  count: int,
  shapes: Sequence[Any],
  dtype,
  like: Any,
  after: bool = True,
) -> tuple[Array, ...]:
  """:func:`_loop_sum` of several sums at once, one per shape. With
  ``after``, the zeros are made after ``like``'s first array: XLA would
  otherwise allocate the carries of a backward pass's loops all at its
  start (a scanned transformer's low rank and exact diagonal). The chunked
  sums of :func:`_sum_over_example_chunks` opt out: there it moved K-FAC's
  peak up (conv input factors, +6-7%)."""
  init = tuple(_zeros_varying(shape, dtype, like) for shape in shapes)
  first = [x for x in jax.tree.leaves(like) if isinstance(x, jax.Array)]
  if first and after:
    init = tuple(_after(z, first[0]) for z in init)

  def add(total, j):
    return tuple(t + p.astype(dtype) for t, p in zip(total, fn(j))), None

  return lax.scan(add, init, jnp.arange(count))[0]


def _zeros_varying(shape, dtype, like: Any) -> Array:
  """Zeros varying over the manual mesh axes of ``like``'s arrays or shapes
  (a loop carry must vary like the sums added to it under ``shard_map``)."""
  zeros = jnp.zeros(shape, dtype)
  vma = sorted(
    {
      a
      for x in jax.tree.leaves(like)
      if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
      for a in numerics.varying_axes(
        jax.typeof(x) if isinstance(x, jax.Array) else x
      )
    }
  )
  return lax.pcast(zeros, tuple(vma), to="varying") if vma else zeros


def _first(x: Array | None) -> Array | None:
  return None if x is None else x[0]


def _put(values: Sequence[Any], index: int, value: Any) -> tuple:
  """``values`` as a tuple with entry ``index`` replaced."""
  out = list(values)
  out[index] = value
  return tuple(out)


# --------------------------------------------------------------------------
# Examples mixed across the batch.


class FisherMixedExamplesWarning(UserWarning):
  """``apply_fn`` combines different examples of the batch.

  Every estimator assumes that output ``n`` depends on input ``n`` only, so
  that the Fisher is a sum over per-example gradients. A model that reduces
  over the batch axis (a BatchNorm with batch statistics, in-batch
  similarities, attention across examples) breaks that: its per-example
  gradients are not defined, and the layer path (one batched pass) and the
  per-example path (one example at a time) compute different things, neither
  of them this model's Fisher. Evaluate the model as at inference (Linen
  ``BatchNorm(use_running_average=True)``, NNX ``use_running_average=True``
  or ``model.eval()``), whose running statistics the layer path covers.
  Silence it with ``warnings.simplefilter("ignore",
  FisherMixedExamplesWarning)``.

  It also warns where ``apply_fn`` draws random values for each example
  (an active dropout, noise added to the inputs): the per-example path runs
  the model on one example at a time with the same key, so every example
  gets the same draw there and the two paths differ. A draw shared by the
  examples (a mask broadcast over them, a random-features matrix) is the
  same on both paths and does not warn.

  The check follows the examples' axis through the traced model, also where
  a reshape merges it with the axes after it (a ``BatchNorm`` over ``x
  .reshape(B * T, C)`` warns). It is a check, not a proof: where it cannot
  follow the examples (indexing the batch with computed indices, ``x
  [perm]``; a reshape that puts them inside another axis) it stays silent.
  """


_REDUCTIONS = (
  "reduce_sum",
  "reduce_max",
  "reduce_min",
  "reduce_prod",
  "reduce_and",
  "reduce_or",
  "reduce_xor",
  "argmax",
  "argmin",
)
_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")


def _inner_jaxpr(eqn):
  """The body of a call-like equation (``pjit``, ``remat``, custom
  derivatives), or None."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = _open_jaxpr(eqn.params.get(key))
    if sub is not None:
      return sub[0]
  return None


# Primitives that draw random bits (typed keys, raw keys, the RBG generator).
_RANDOM = ("random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform")
# Found by the check when a value drawn at random meets the examples.
RANDOM_PER_EXAMPLE = "random values for each example"


def _bodies(eqn) -> list:
  """Every jaxpr among ``eqn``'s parameters (call, scan, cond and loop
  bodies), opened."""
  subs = []
  for value in eqn.params.values():
    for sub in value if isinstance(value, (list, tuple)) else (value,):
      opened = _open_jaxpr(sub)
      if opened is not None:
        subs.append(opened[0])
  return subs


def _draws_random(eqn) -> bool:
  """Whether ``eqn``, or any equation inside it, draws random bits."""
  return eqn.primitive.name in _RANDOM or any(
    _draws_random(e) for body in _bodies(eqn) for e in body.eqns
  )


def _shape(v) -> tuple:
  return tuple(getattr(v.aval, "shape", ()))


def _ones(shape: tuple) -> frozenset:
  return frozenset(i for i, n in enumerate(shape) if n == 1)


def _shared_after(eqn, operands: list) -> frozenset:
  """The axes along which a value computed from random draws alone is the
  same at every index (``operands``: each draw's such axes, None for an
  operand not drawn): size-one axes, axes a broadcast adds, and axes every
  drawn operand of an elementwise equation shares."""
  out = _shape(eqn.outvars[0])
  shared = _ones(out)
  sets = [s for s in operands if s is not None]
  if eqn.primitive.name == "broadcast_in_dim" and sets:
    dims = eqn.params["broadcast_dimensions"]
    kept = {dims[i] for i in sets[0]} | {
      d for i, d in enumerate(dims) if _shape(eqn.invars[0])[i] == 1
    }
    return shared | (frozenset(range(len(out))) - set(dims)) | kept
  ranks = {len(_shape(v)) for v in eqn.invars if _shape(v)}
  if sets and ranks <= {len(out)}:  # elementwise
    return shared | frozenset.intersection(*sets)
  return shared


def _random_per_example(eqn, ins: list, drawn: list) -> bool:
  """Whether elementwise ``eqn`` gives each example its own random values:
  an operand drawn at random (``drawn``: the axes along which that draw is
  shared, or None for an operand not drawn) varies along the examples'
  axis, where another operand holds them (``ins``), as a dropout mask does.
  A draw shared by the examples (a mask broadcast over them, a
  random-features matrix contracted with them) is the same on both paths."""
  if (
    all(s is None for s in drawn)
    or len(eqn.outvars) != 1
    or eqn.primitive.name in ("dot_general", "conv_general_dilated")
    or _bodies(eqn)
  ):
    return False  # a contraction, or a call, scan or cond (walked into)
  out = _shape(eqn.outvars[0])
  axes = {a for a in ins if a is not None}
  if len(axes) != 1:
    return False
  (ax,) = axes
  shapes = [_shape(v) for v in eqn.invars]
  if ax >= len(out) or any(sh and len(sh) != len(out) for sh in shapes):
    return False  # not elementwise
  return out[ax] > 1 and any(
    s is not None and ax not in s and len(sh) == len(out) and sh[ax] > 1
    for s, sh in zip(drawn, shapes)
  )


def _reshaped_example_axis(shape: tuple, ax: int, out: tuple, batch: int):
  """The axis of a row-major reshape to ``out`` holding the examples of
  ``shape``'s axis ``ax``, or None.

  The examples may share an axis with others (``(B, T, C) -> (B * T,
  C)``), as the outer factor: each index of it then lies in one example,
  and a reduction over it mixes them. That needs the axes before ``ax``
  reshaped among themselves, and whole blocks of examples per index.
  """
  before = math.prod(shape[:ax])
  j, acc = 0, 1
  while j < len(out) and acc < before:
    acc *= out[j]
    j += 1
  while j < len(out) - 1 and out[j] == 1 and shape[ax] != 1:
    j += 1  # size-one axes inserted before the examples'
  if acc != before or j >= len(out):
    return None
  return j if out[j] % batch == 0 else None


def _example_axis(eqn, axes: list, batch: int) -> int | None:
  """The output axis holding the examples, given each operand's (``axes``,
  None for none): conservative, None when unsure (the output is then not
  followed further). The axis may hold other positions too, each index in
  one example (:func:`_reshaped_example_axis`)."""
  name, p = eqn.primitive.name, eqn.params
  out: tuple[int, ...] = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
  ax: int = next(a for a in axes if a is not None)
  if name in _REDUCTIONS:  # not over the examples (that mixes them)
    return ax - sum(1 for d in p["axes"] if d < ax)
  if name == "transpose":
    return list(p["permutation"]).index(ax)
  if name == "reshape":
    if p.get("dimensions"):
      return None
    shape = tuple(eqn.invars[0].aval.shape)
    return _reshaped_example_axis(shape, ax, out, batch)
  if name == "broadcast_in_dim":
    return p["broadcast_dimensions"][ax]
  if name == "squeeze":
    return ax - sum(1 for d in p["dimensions"] if d < ax)
  if name.startswith("reduce_window"):  # pooling, the examples' axis alone
    alone = (
      p["window_dimensions"][ax] == 1
      and p["window_strides"][ax] == 1
      and tuple(p["padding"][ax]) == (0, 0)
    )
    return ax if alone else None
  if name == "dot_general":
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    if axes[0] is not None:
      if axes[0] in lb:
        return lb.index(axes[0])
      free = [d for d in range(eqn.invars[0].aval.ndim) if d not in lc + lb]
      return len(lb) + free.index(axes[0])
    free = [d for d in range(eqn.invars[1].aval.ndim) if d not in rc + rb]
    n_lhs = eqn.invars[0].aval.ndim - len(lc) - len(lb)
    if axes[1] in rb:
      return rb.index(axes[1])
    return len(lb) + n_lhs + free.index(axes[1])
  if name == "conv_general_dilated":
    dn = p["dimension_numbers"]
    ok = axes[0] == dn.lhs_spec[0] and axes[1] is None
    return dn.out_spec[0] if ok else None
  if name == "gather":
    ok = axes[0] is None and axes[1] == 0
    return 0 if ok and 0 not in p["dimension_numbers"].offset_dims else None
  if name in ("concatenate", "pad") or name in _CUMULATIVE:
    if len(set(a for a in axes if a is not None)) != 1:
      return None
    if name == "pad":
      return ax if tuple(p["padding_config"][ax]) == (0, 0, 0) else None
    return ax if p.get("dimension", p.get("axis")) != ax else None
  # Elementwise (size-one axes broadcast): every operand the output's rank
  # or a scalar, the examples on one axis.
  shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
  ok = len(eqn.outvars) == 1 and all(
    not sh
    or (len(sh) == len(out) and all(a in (1, o) for a, o in zip(sh, out)))
    for sh in shapes
  )
  same = len(set(a for a in axes if a is not None)) == 1
  sizes = {shapes[i][a] for i, a in enumerate(axes) if a is not None}
  size = out[ax] if ax < len(out) else 0
  kept = sizes == {size} and size % batch == 0
  return ax if ok and same and kept else None


def _mixing(
  jaxpr, axes: dict, batch: int, drawn: dict | None = None
) -> str | None:
  """The first operation of ``jaxpr`` that combines different examples, or
  gives each its own random values, or None. ``axes`` maps a variable
  holding the examples to their axis (the inputs': 0) and grows with the
  variables that follow; ``drawn`` maps the variables computed from random
  draws but not from the examples to the axes along which each is shared
  (:func:`_shared_after`), and grows too."""
  drawn = {} if drawn is None else drawn

  def carried(v, w) -> None:
    """``w`` (across a call, scan or cond boundary) drawn as ``v`` is."""
    if isinstance(v, jex.Var) and v in drawn:
      same = len(_shape(v)) == len(_shape(w))  # else a scan's slice
      s = drawn[v] if same else {a - 1 for a in drawn[v] if a > 0}
      drawn[w] = _ones(_shape(w)) | frozenset(s)

  def walk_into(body, invars_axes, outer=()) -> str | None:
    inner = {w: a for w, a in invars_axes if a is not None}
    for v, w in zip(outer, body.invars):
      carried(v, w)
    found = _mixing(body, inner, batch, drawn)
    axes.update(inner)  # body variables are distinct objects
    return found

  for eqn in jaxpr.eqns:
    ins = [axes.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars]
    rand = [
      drawn.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars
    ]
    if all(a is None for a in ins):
      if any(s is not None for s in rand) or _draws_random(eqn):
        one = len(eqn.outvars) == 1
        for o in eqn.outvars:
          drawn[o] = _shared_after(eqn, rand) if one else _ones(_shape(o))
      continue
    name, p = eqn.primitive.name, eqn.params
    if _random_per_example(eqn, ins, rand):
      return f"{RANDOM_PER_EXAMPLE} ({name} of a random draw with the examples)"
    if name == "scan":  # consts and carry keep their axes; xs lose axis 0
      body, n = p["jaxpr"].jaxpr, p["num_consts"] + p["num_carry"]
      sliced = [None if a in (None, 0) else a - 1 for a in ins[n:]]
      found = walk_into(body, zip(body.invars, ins[:n] + sliced), eqn.invars)
      if found:
        return found
      k = p["num_carry"]
      for j, (o, w) in enumerate(zip(eqn.outvars, body.outvars)):
        a = axes.get(w) if isinstance(w, jex.Var) else None
        if a is not None:
          axes[o] = a if j < k else a + 1
      continue
    if name == "cond":
      for branch in p["branches"]:
        found = walk_into(
          branch.jaxpr, zip(branch.jaxpr.invars, ins[1:]), eqn.invars[1:]
        )
        if found:
          return found
      continue
    body = None if name == "while" else _inner_jaxpr(eqn)
    if body is not None:
      found = walk_into(body, zip(body.invars, ins), eqn.invars)
      if found:
        return found
      for o, w in zip(eqn.outvars, body.outvars):
        if isinstance(w, jex.Var) and w in axes:
          axes[o] = axes[w]
        else:
          carried(w, o)
      continue
    if name in _REDUCTIONS and ins[0] in p["axes"]:
      return f"{name} over the examples' axis"
    if name in _CUMULATIVE and ins[0] == p["axis"]:
      return f"{name} along the examples' axis"
    if name == "sort" and p["dimension"] in ins:
      return "sort along the examples' axis"
    # Reordering or shifting the examples (x[::-1], jnp.roll, x[1:]):
    # output n then reads another example.
    if name == "rev" and ins[0] in p["dimensions"]:
      return "rev along the examples' axis"
    if name == "concatenate" and p["dimension"] in ins:
      return "concatenate along the examples' axis"
    if name == "slice" and ins[0] is not None:
      ax, strides = ins[0], p["strides"]
      size = eqn.invars[0].aval.shape[ax]  # B, or B times other positions
      window = (p["start_indices"][ax], p["limit_indices"][ax])
      if window != (0, size) or (strides is not None and strides[ax] != 1):
        return "slice along the examples' axis"
    if name == "dynamic_slice" and ins[0] is not None:
      if p["slice_sizes"][ins[0]] != eqn.invars[0].aval.shape[ins[0]]:
        return "dynamic_slice along the examples' axis"
    if name == "dot_general":
      (lc, rc), (lb, rb) = p["dimension_numbers"]
      if ins[0] in lc or ins[1] in rc:
        return "dot_general contracting the examples' axis"
      if None not in ins[:2] and not (
        ins[0] in lb and ins[1] in rb and lb.index(ins[0]) == rb.index(ins[1])
      ):
        return "dot_general pairing every two examples"
    if name == "conv_general_dilated" and (
      ins[0] not in (None, p["dimension_numbers"].lhs_spec[0])
    ):
      return "conv_general_dilated along the examples' axis"
    if name == "while" or not eqn.outvars:
      continue
    if name == "split":  # jnp.split along another axis
      if ins[0] is not None and p["axis"] != ins[0]:
        axes.update((o, ins[0]) for o in eqn.outvars)
      continue
    try:
      a = _example_axis(eqn, ins, batch)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
      a = None  # an unforeseen equation: stop following (a hint, not a rule)
    if a is not None:
      axes[eqn.outvars[0]] = a
  return None


def _caller_stacklevel() -> int:
  """The :func:`warnings.warn` stacklevel of the first frame outside this
  package (the user's call into an estimator, or JAX tracing it)."""
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  frame, level = sys._getframe(1), 1
  while frame is not None and os.path.abspath(
    frame.f_code.co_filename
  ).startswith(package + os.sep):
    frame, level = frame.f_back, level + 1
  return level


def check_independent_examples(
  closed, num_leaves: int, batch: int
) -> str | None:
  """Warns (:class:`FisherMixedExamplesWarning`) if the traced ``apply_fn``
  (``closed``, invars: the parameter leaves, then the inputs) combines
  different examples or draws random values for each; returns what does, or
  None."""
  jaxpr = closed.jaxpr
  if batch == 0:  # no examples to mix
    return None
  found = _mixing(jaxpr, dict.fromkeys(jaxpr.invars[num_leaves:], 0), batch)
  if found is not None and found.startswith(RANDOM_PER_EXAMPLE):
    warnings.warn(
      f"apply_fn draws {found}, e.g. an active dropout: the layer path "
      "draws them for the whole batch and the per-example path for one "
      "example at a time, so the two paths give different statistics, and "
      "the per-example path gives every example the same draw. Run apply_fn "
      "deterministically (deterministic=True, model.eval()), as Fisher "
      "estimates usually are; see FisherMixedExamplesWarning.",
      FisherMixedExamplesWarning,
      stacklevel=_caller_stacklevel(),
    )
  elif found is not None:
    warnings.warn(
      f"apply_fn combines different examples of the batch ({found}): "
      "per-example gradients, and every Fisher statistic built from them, "
      "are not defined for such a model. Evaluate it as at inference (e.g. "
      "BatchNorm with running statistics); see FisherMixedExamplesWarning.",
      FisherMixedExamplesWarning,
      stacklevel=_caller_stacklevel(),
    )
  return found


# --------------------------------------------------------------------------
# Coverage: which path computes each leaf, and why.


class FisherFallbackWarning(UserWarning):
  """``method="auto"`` sends a large share of the parameters per example.

  Those leaves cost a per-example backward pass and ``chunk_size`` times
  their size in memory; :func:`coverage` says why each one falls back.
  Silence it with ``warnings.simplefilter("ignore", FisherFallbackWarning)``
  or pick the path explicitly with ``method=``.
  """


@dataclasses.dataclass(frozen=True)
class LeafCoverage:
  """How ``method="auto"`` computes one parameter leaf's statistics.

  Truthy unless the leaf costs a per-example pass (``path ==
  "per_example"``).

  Attributes:
    path: ``"layer"`` (layer statistics from one backward pass for the whole
      batch), ``"unused"`` (``apply_fn`` never reads the leaf, or it has
      size zero: its statistics are zero and cost nothing) or
      ``"per_example"`` (a ``vmap`` of per-example VJPs).
    reason: the rule that matched (``"the kernel of a dot_general"``,
      ``"an elementwise scale (mul)"``, ...) or why none did (``"an operand
      of sort: no layer rule matches"``, ``"used 2 times ..."``).
    kronecker: whether :func:`fisher_optax.fisher.kronecker` also takes its
      K-FAC factors from layer statistics; otherwise that leaf gets
      Shampoo-style factors from per-example gradients (an elementwise
      leaf's, such as a norm scale, formed on the layer path).
  """

  path: str
  reason: str
  kronecker: bool = False

  def __bool__(self) -> bool:
    return self.path != "per_example"


def _elementwise(plan: _Plan, leaf: int) -> bool:
  """Whether a covered leaf's every use is an elementwise scale or shift."""
  uses = plan.uses(leaf)
  return bool(uses) and all(plan.sites[u[0]].kind in _ELEMENTWISE for u in uses)


def _leaf_coverage(plan: _Plan, leaves: Sequence[Any]) -> list[LeafCoverage]:
  out = []
  for leaf, (role, reason) in enumerate(zip(plan.roles, plan.reasons)):
    if role is None:
      path = "unused" if leaf in plan.unused else "per_example"
      out.append(LeafCoverage(path, reason))
    else:
      site = plan.sites[role[0]]
      uses = plan.special.get(leaf)
      # K-FAC factors need one use: a conv outside scans or stacked along
      # them, any other layer in a scan that slices the leaf (factors per
      # layer).
      if uses is None:
        one_use = True
      elif len(uses) != 1:
        one_use = False
      elif site.kind in _CHUNKED:  # outside scans, or stacked along them
        one_use = _stacked_only(uses[0][2])
      else:
        one_use = "xs" in uses[0][2]
      kron = one_use and _kron_ok(site, role[1])
      out.append(LeafCoverage("layer", reason, kron))
  return out


def coverage(
  apply_fn: Callable[[PyTree, PyTree], PyTree], params: PyTree, inputs: PyTree
) -> PyTree:
  """Which path computes each parameter leaf under ``method="auto"``, and why.

  The layer path recognises, in the traced ``apply_fn`` and whatever module
  produced it: any ``dot_general`` of an activation with a parameter
  (``Dense``, ``DenseGeneral``, attention projections, ``Einsum``, a tied
  head, per-head kernels with ``dot_general`` batch axes) and its bias,
  convolution kernels (``conv_general_dilated``: Linen
  and NNX ``Conv`` with any strides, padding, dilation and feature groups),
  embedding gathers, and elementwise scale and shift parameters (norm
  scales and biases, BatchNorm with running statistics, learned positions,
  conv biases), a kernel times a constant scalar, also inside ``scan``
  bodies (stacked layers, recurrent cells) and for a leaf with several such
  uses (tied embeddings, a conv kernel applied twice). A leaf may reach
  these layers through a function of parameters alone (``WeightNorm``,
  ``SpectralNorm``, a masked or weight-standardised kernel,
  ``softplus(p)``; in a scan's body when the scan slices every leaf the
  function reads): a VJP per example takes the layer's gradients back to
  it. K-FAC factors (``kronecker``) need one use of the leaf
  itself (a kernel shared by a scan's iterations is one use, the iterations
  counted as positions: K-FAC's "expand" convention), or a stack of layers
  along a scan: a leaf used twice, or computed from parameters, has none.
  A leaf that ``apply_fn`` never reads (an unused head) is ``"unused"``:
  zero statistics, no per-example pass. Only traces ``apply_fn``
  (no FLOPs), so ``params`` and ``inputs`` may be ``jax.ShapeDtypeStruct``
  trees. A model that combines the examples of a batch (``BatchNorm`` on
  the batch's statistics) warns :class:`FisherMixedExamplesWarning`, as the
  estimators do: no path gives it per-example gradients.

  Args:
    apply_fn: ``apply_fn(params, inputs) -> outputs``, as in
      :func:`fisher_optax.fisher.diagonal`.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
    inputs: a batch of inputs (leading batch axis).

  Returns:
    A params-shaped tree of :class:`LeafCoverage` (truthy unless the leaf
    needs a per-example pass).

  Example:
    >>> import jax.numpy as jnp
    >>> from fisher_optax import fisher
    >>> def apply_fn(p, x):
    ...   h = jnp.tanh(x @ p["w"] + p["b"]) * p["scale"]
    ...   return jnp.maximum(h * p["t"].sum(), p["floor"])
    >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2),
    ...           "scale": jnp.ones(2), "t": jnp.ones(2),
    ...           "floor": jnp.zeros(2)}
    >>> cov = fisher.coverage(apply_fn, params, jnp.ones((4, 3)))
    >>> cov["w"].path, cov["scale"].reason
    ('layer', 'an elementwise scale (mul)')
    >>> cov["t"].reason  # t.sum() depends on parameters alone
    'an elementwise scale (mul), a value computed from parameters (a VJP per example)'
    >>> cov["floor"].path, cov["floor"].reason
    ('per_example', 'an operand of max: no layer rule matches')
    >>> import jax
    >>> def stack_fn(p, x):  # two layers (2, 3, 3) run by a scan
    ...   layer = lambda h, w: (jnp.tanh(h @ w), None)
    ...   return jax.lax.scan(layer, x, p["w"])[0]
    >>> cov = fisher.coverage(stack_fn, {"w": jnp.ones((2, 3, 3))},
    ...                       jnp.ones((4, 3)))
    >>> cov["w"].reason
    'the kernel of a dot_general, stacked along the iterations of a scan'
  """
  leaves, treedef, _, closed, out_def, batch = _trace(apply_fn, params, inputs)
  # As the estimators require (a tuple reports as its type).
  check_apply_outputs(
    jax.tree_util.tree_unflatten(out_def, closed.out_avals), batch
  )
  check_independent_examples(closed, len(leaves), batch)
  plan = _make_plan(closed, len(leaves), batch)
  return jax.tree_util.tree_unflatten(treedef, _leaf_coverage(plan, leaves))


# Warnings already given (once per message, not per call: estimators run
# every step; two models whose leaves share names but not the reasons they
# fall back each warn).
_WARNED: set[str] = set()


def warn_fallback(
  tape: LayerTape,
  *,
  structure: str = "diag",
  threshold: float = 0.1,
  stacklevel: int = 2,
) -> None:
  """Warns once if more than ``threshold`` of the parameters fall back.

  Args:
    tape: the recorded forward pass.
    structure: ``"kron"`` counts leaves without K-FAC factors as falling
      back, except elementwise ones (their per-example gradients come from
      the layer path); anything else counts leaves off the layer path.
    threshold: the share of parameters (by count) that triggers it.
    stacklevel: passed to :func:`warnings.warn`.
  """
  leaves = tape._leaves
  plan = tape._plan
  cov = _leaf_coverage(plan, leaves)
  kron = structure == "kron"
  # Unused leaves cost nothing on any path: the share is of the used ones.
  used = [i for i in range(len(leaves)) if i not in plan.unused]
  sizes = [math.prod(np.shape(x)) for x in leaves]
  total = sum(sizes[i] for i in used)
  off = [
    i
    for i in used
    if not (cov[i].kronecker or _elementwise(plan, i) if kron else cov[i])
  ]
  share = sum(sizes[i] for i in off) / max(total, 1)
  if share <= threshold:
    return
  skeleton = jax.tree_util.tree_unflatten(tape._treedef, [0] * len(leaves))
  names = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(skeleton)[0]
  ]
  what = "K-FAC factors" if kron else "layer statistics"
  listed = "; ".join(
    f"{names[i]}: {'no K-FAC rule' if kron and cov[i] else cov[i].reason}"
    for i in off
  )
  message = (
    f"method='auto' has no {what} for {share:.0%} of the parameters it "
    f"uses and computes them per example (slower, more memory): {listed}. "
    "fisher.coverage(apply_fn, params, inputs) says which path each leaf "
    "takes."
  )
  if message in _WARNED:
    return
  _WARNED.add(message)
  warnings.warn(message, FisherFallbackWarning, stacklevel=stacklevel + 1)
