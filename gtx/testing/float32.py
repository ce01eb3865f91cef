"""Float32 results against a float64 reference, within what float32 arithmetic can hold on that input.

Two float32 paths (a C kernel and torch ops, two backends) sum in different orders, and the order a
CPU's vectors and threads take decides their last bits; where scores span hundreds those bits reach
1e-4 and more. Compared with each other under a fixed tolerance they give a verdict that depends on
the CPU. Here each float32 result is compared with a float64 one instead, within a bound that
depends on the input alone: the same verdict on any CPU, vector width and thread count.

``float64_reference(fn, *inputs)`` runs ``fn`` on the inputs' exact values in float64, once as it is (the
reference), then ``samples`` times with float32's errors simulated (Monte Carlo arithmetic: ``u``
below is uniform in [-1, 1], drawn anew for each element from a seeded generator):

- an op's result is rounded: times ``1 + u * UNIT`` (UNIT = 2**-24), unless it and its operands
  are integers float32 holds exactly (counts, masks);
- a sum of ``n`` terms (products, reductions, scatter-adds, convolutions) is off by
  ``u * sqrt(n) * UNIT * sum |terms|``, the same op run on the terms' magnitudes: float32's error for
  sums in any order (sequential, in vector lanes, pairwise), a random walk over its partial sums;
- softmax's denominator is such a sum, and its exponent ``x - lse`` is rounded at the magnitude of
  ``x`` and ``lse``, as a kernel that forms it takes it;
- an elementary function (exp, log, ...) has its argument off by ``ARGUMENT`` roundings and its
  result by ``RESULT``: vectorized, they are within a few ulp, and their argument reduction loses
  about as much (the C kernels' exp: at most 0.7 |x| ulp, measured 0.25 |x| ulp root mean square in
  their scalar build); softmax's exponent likewise.

How far those runs spread around the reference, per element (their root mean square), is how far
float32 arithmetic can move that element on that input. ``Reference.check(got)`` accepts a float32
result whose every element lies within ``SPREADS`` times that spread, plus ``SPREADS`` roundings of
the element itself and of its output's root mean square (``_bound``) and float32's underflow
(``UNDERFLOW``), of the float64 one. A wrong term, index or scale moves results by far more.

``fn`` returns a tensor or a sequence of tensors (None where a gradient is absent); it computes in
the inputs' dtype (its modules converted with ``.double()``; it may rank or count in float32), and
the reference refuses results in another dtype. It runs on one torch thread, so that every op
passes through this thread's dispatch (the C kernels, float32 only, never run in it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

UNIT = 2.0**-24  # float32's unit roundoff: a rounding moves a value by at most this share of it
SAMPLES = 8  # simulated runs per reference
SPREADS = 32  # the bound, in spreads (module doc)
# what float32 cannot hold at all: values under its smallest normal, relative to its precision
UNDERFLOW = torch.finfo(torch.float32).tiny / torch.finfo(torch.float32).eps
# float64 against float64: float64 holds 29 bits more than float32, 9 of them left for two algorithms'
# different orders (``Reference.check_float64``)
FLOAT64 = 2.0**-20
ARGUMENT, RESULT = 2.0, 2.0  # an elementary function's roundings (module doc)
FUNCTIONS = {"exp", "exp2", "expm1", "log", "log2", "log1p", "sigmoid", "tanh", "sin", "cos", "pow", "sqrt", "rsqrt"}
# ops that move, pick or negate values: exact in float32
EXACT = {
    "clone", "_to_copy", "copy_", "cat", "stack", "index_select", "gather", "where", "masked_fill", "masked_fill_",
    "relu", "relu_", "neg", "abs", "amax", "amin", "max", "min", "sort", "topk", "constant_pad_nd", "index",
    "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "empty", "empty_like", "new_zeros", "new_ones",
    "new_full", "new_empty", "fill_", "zero_", "clamp", "clamp_min", "clamp_max", "sign", "sign_", "scatter",
    "threshold_backward", "detach", "lift_fresh", "select_scatter", "slice_scatter", "masked_scatter", "tril",
    "triu", "tril_", "triu_", "flip", "roll", "repeat", "expand_copy",
}  # fmt: skip
PRODUCTS = {"mm", "bmm", "mv", "dot", "vdot", "addmm", "baddbmm", "addmv", "addbmm", "addmm_", "baddbmm_"}
REDUCTIONS = {"sum", "mean", "nansum", "cumsum"}  # along argument 1's dims (none: all)
SCATTERS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "embedding_dense_backward"}
SOFTMAX = {"_softmax", "_safe_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}
SOFTMAX |= {"logsumexp"}
HELD = 4  # the latest sums held: a backward forms dp and the values' gradient before softmax's


def _scores(q, k, mask, causal: bool, scale):
    """(B, H, L, S) attention scores as SDPA forms them: q . k times scale (None: D ** -0.5), the mask
    (bool: True attends; float: added) and, where causal, the upper triangle hidden."""
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return s


def _attention(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """SDPA's CPU flash kernel (out, log-sum-exp per query) as its steps: a query with no key gets 0 and 0."""
    assert dropout_p == 0.0, "the float64 reference runs attention without dropout"
    s = _scores(q, k, attn_mask, is_causal, scale)
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(lse == -math.inf, 0.0)
    return torch.exp(s - lse[..., None]) @ v, lse


def _attention_backward(grad, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """The flash kernel's backward (dq, dk, dv) as its steps: p from the saved log-sum-exp."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = torch.exp(_scores(q, k, attn_mask, is_causal, scale) - lse[..., None])
    ds = p * (grad @ v.transpose(-2, -1) - (grad * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ grad


FUSED = {
    "_scaled_dot_product_flash_attention_for_cpu": _attention,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward,
}


def _count(x: torch.Tensor, dims) -> int:
    """How many elements of x each reduction over ``dims`` (an int, a list; None or []: all) sums."""
    if dims is None or (isinstance(dims, (list, tuple)) and not dims) or x.dim() == 0:
        return x.numel()
    return math.prod(x.shape[d] for d in ([dims] if isinstance(dims, int) else dims))


def _terms(name: str, args: tuple) -> int:
    """How many terms each element of a summing op's result adds up (at most)."""
    if name in PRODUCTS:
        added = name.startswith(("add", "badd"))  # and the tensor they add to
        return args[1 if added else 0].shape[-1] + added
    if name in REDUCTIONS:
        return _count(args[0], args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None)
    if name in ("index_add", "index_add_"):
        return int(torch.bincount(args[2].flatten()).max() if args[2].numel() else 0) + 1
    if name == "embedding_dense_backward":
        return int(torch.bincount(args[1].flatten()).max() if args[1].numel() else 0)
    if name in ("scatter_add", "scatter_add_"):
        return -(-args[3].numel() // max(1, args[0].numel())) + 1
    if name in ("index_put", "index_put_", "_index_put_impl_"):
        return -(-args[2].numel() // max(1, args[0].numel())) + 1
    if name == "convolution":
        return args[1][0].numel()
    if name == "convolution_backward":  # the input's gradient sums over the kernel, the weight's over positions
        return max(args[2][0].numel(), args[0].numel() // max(1, args[0].shape[1]))
    return 1


def _sums(name: str, args: tuple) -> bool:
    """Whether the op adds up terms (``_terms``): index_put only where it accumulates."""
    accumulates = name in ("index_put", "index_put_", "_index_put_impl_") and len(args) > 3 and bool(args[3])
    return name in PRODUCTS | REDUCTIONS | SCATTERS | {"convolution", "convolution_backward"} or accumulates


class _Rounding(TorchDispatchMode):
    """Runs each op on ``dtype`` tensors with float32's errors simulated (module doc)."""

    def __init__(self, generator: torch.Generator, dtype: torch.dtype):
        super().__init__()
        self.generator, self.dtype = generator, dtype
        # the latest sums (or tensors shaped like one, formed from it) and their sum |terms|, laid out
        # alike: a softmax backward's dp, where a kernel forms sum p dp from the output instead (held, so
        # that their storage is not another tensor's)
        self.sums: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _ours(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.dtype == self.dtype and x.numel() > 0

    def _u(self, shape, scale: float) -> torch.Tensor:
        """u * scale * UNIT, u uniform in [-1, 1], in ``dtype``."""
        return torch.rand(shape, generator=self.generator).mul_(2 * scale * UNIT).sub_(scale * UNIT).to(self.dtype)

    def _moved(self, x: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
        """x + by where that is finite; infinities, and float64's extremes (masks: finfo.min) that
        would overflow, kept."""
        y = x + by
        return y if y.isfinite().all() else torch.where(y.isfinite(), y, x)

    def _rounded(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self._moved(x, x * self._u(x.shape, scale))

    def _argument(self, x: torch.Tensor) -> torch.Tensor:
        """An elementary function's argument as its reduction takes it: ``ARGUMENT`` roundings off."""
        return self._rounded(x, ARGUMENT)

    def _magnitude(self, x: torch.Tensor) -> torch.Tensor | None:
        """sum |terms| for x where x is (a view of) one of the latest sums, else None."""
        for held, magnitude in self.sums:
            if x.untyped_storage().data_ptr() == held.untyped_storage().data_ptr():
                return magnitude.as_strided(x.shape, x.stride(), x.storage_offset())
        return None

    def _held(self, out: torch.Tensor, magnitude: torch.Tensor) -> None:
        """Hold ``out`` (a sum, or formed from one) with its magnitudes laid out in storage as it is."""
        laid = torch.empty_strided(out.shape, out.stride(), dtype=magnitude.dtype)
        if out.storage_offset() == 0 and laid.untyped_storage().nbytes() == out.untyped_storage().nbytes():
            self.sums = [(out, laid.copy_(magnitude)), *self.sums[: HELD - 1]]

    def _carried(self, args, out) -> None:
        """A tensor shaped like one of the latest sums and formed from it (its gradient masked, a NaN
        zeroed) is held too, with its magnitudes."""
        if not self.sums or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        for a in args:
            if isinstance(a, torch.Tensor) and a.shape == out.shape and a is not out:
                magnitude = self._magnitude(a)
                if magnitude is not None:
                    self._held(out, magnitude)
                    return

    def _softmax(self, name: str, out: torch.Tensor, args: tuple) -> torch.Tensor:
        """The softmax family's errors: the denominator's sum (one per row), the exponent's rounding."""
        x, dim = args[0], args[1]
        if name == "logsumexp":  # log z: z's relative error, absolute
            return self._moved(out, self._u(out.shape, math.sqrt(_count(x, dim))))
        if name in ("_softmax_backward_data", "_log_softmax_backward_data"):
            grad, y, dim = args[0], args[1], args[2]
            n, weights = y.shape[dim], y.exp() if name.startswith("_log") else y
            share = 1.0 if name.startswith("_log") else y
            terms = (grad * share).abs().sum(dim, keepdim=True)
            magnitude = self._magnitude(grad)
            if magnitude is not None:
                # dp a product just formed (a view of it): a kernel that forms sum p dp from the output
                # instead errs by the size of dp's terms, where dp's own may cancel (a query of one key:
                # dp - sum p dp = 0 exactly)
                terms = torch.maximum(terms, (magnitude * share).abs().sum(dim, keepdim=True))
            return self._moved(out, -weights * terms * self._u(list(terms.shape), math.sqrt(n)))
        n = x.shape[dim]
        finite = x.isfinite() & (x.abs() < 1e300)  # masked entries (-inf, finfo.min) stay out
        lse = torch.logsumexp(torch.where(finite, x, -math.inf), dim, keepdim=True).nan_to_num(neginf=0.0)
        size = torch.where(finite, x.abs() + lse.abs(), 0.0)
        shift = self._u(x.shape, ARGUMENT) * size + self._u(lse.shape, math.sqrt(n))
        return self._moved(out, shift) if name == "_log_softmax" else self._moved(out, out * shift)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        aliases = func.is_view or any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        )
        out = func(*args, **kwargs) if aliases or name in EXACT else self._run(func, name, args, kwargs)
        if not aliases and out is not None:
            self._carried(args, out)
        return out

    def _run(self, func, name: str, args: tuple, kwargs: dict):
        if name in FUSED:  # the fused kernel's steps, each op with its errors
            with self:
                return FUSED[name](*args, **kwargs)
        mutable = func._schema.is_mutable
        function = name.rstrip("_") in FUNCTIONS
        if all(self._integral(a) for a in tree_leaves(args) if self._ours(a)):  # counts: exact in float32
            out = func(*args, **kwargs)
            outs = out if isinstance(out, (tuple, list)) else [out]
            if all(self._integral(o) for o in outs if self._ours(o)):
                return out
            return self._results(
                out, [self._rounded(o, RESULT if function else 1.0) if self._ours(o) else o for o in outs], mutable
            )
        if function:  # the argument rounded (in place for exp_: its argument is its result)
            if mutable:
                args[0].copy_(self._argument(args[0]))
            else:
                args = tree_map(lambda a: self._argument(a) if self._ours(a) else a, args)
        magnitude = None
        if _sums(name, args):  # the same op on the terms' magnitudes: sum |terms| per element
            wide = {
                k: abs(v) if k in ("alpha", "beta") and isinstance(v, (int, float)) else v for k, v in kwargs.items()
            }
            magnitude = func(*tree_map(lambda a: a.abs() if self._ours(a) else a, args), **wide)
        out = func(*args, **kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if magnitude is not None:
            n = math.sqrt(_terms(name, args))
            sizes = list(magnitude) if isinstance(magnitude, (tuple, list)) else [magnitude]
            outs = [self._moved(o, m * self._u(o.shape, n)) if self._ours(o) else o for o, m in zip(outs, sizes)]
        if name in SOFTMAX and self._ours(outs[0]):
            outs[0] = self._softmax(name, outs[0], args)
        outs = [self._rounded(o, RESULT if function else 1.0) if self._ours(o) else o for o in outs]
        if magnitude is not None and not mutable and len(outs) == 1:
            self._held(outs[0], magnitude)
        return self._results(out, outs, mutable)

    def _results(self, out, outs: list, mutable: bool):
        """The op's result ``out`` with the values ``outs``: written into its own tensors where it is in place."""
        if mutable:
            for target, o in zip(out if isinstance(out, (tuple, list)) else [out], outs):
                if self._ours(target) and target is not o:
                    target.copy_(o)
            return out
        return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]

    def _integral(self, x: torch.Tensor) -> bool:
        """x holds integers that float32 holds exactly (counts, masks): sums and products of them are exact."""
        return bool(((x == x.trunc()) & (x.abs() <= 2**24)).all())


def _outputs(result) -> list[torch.Tensor | None]:
    if isinstance(result, torch.Tensor) or result is None:
        return [result]
    return list(result)


@dataclass
class Reference:
    """``fn``'s outputs in float64 (``values``) and per element the distance from them a float32
    result may lie at (``bound``), None where ``fn`` returned None."""

    values: list[torch.Tensor | None]
    bound: list[torch.Tensor | None]

    def margin(self, got) -> float:
        """The largest of ``got``'s distances from the reference in bounds (1: at the bound)."""
        worst = 0.0
        for g, want, bound in zip(_outputs(got), self.values, self.bound):
            if g is not None and want is not None:
                err = (g.detach().to(want.dtype) - want).abs()
                ratio = torch.where(want.isfinite(), err / bound, 0.0)
                worst = max(worst, float(ratio.max()) if ratio.numel() else 0.0)
        return worst

    def check_float64(self, got, what: str = "the float64 result") -> float:
        """``got`` computed in float64 by another algorithm for the same values (a definition written
        out, element by element): within the bound shrunk ``FLOAT64`` times; its margin there."""
        return Reference(self.values, [b if b is None else b * FLOAT64 for b in self.bound]).check(got, what)

    def check(self, got, what: str = "the float32 result") -> float:
        """Every element of ``got`` (fn's outputs, computed in float32) within the bound of the
        reference, the same infinities and NaNs where it has them; its margin. AssertionError naming
        ``what``, the output, how many elements are off and the worst."""
        outs = _outputs(got)
        assert len(outs) == len(self.values), f"{what}: {len(outs)} outputs, the reference has {len(self.values)}"
        for i, (g, want, bound) in enumerate(zip(outs, self.values, self.bound)):
            where = f"{what}, output {i}"
            assert (g is None) == (want is None), (
                f"{where}: {'None' if g is None else 'a tensor'} against the reference's"
            )
            if g is None:
                continue
            assert g.shape == want.shape, f"{where}: shape {tuple(g.shape)}, the reference's {tuple(want.shape)}"
            g = g.detach().to(want.dtype)
            finite = want.isfinite()
            same = torch.equal(g[~finite].nan_to_num(), want[~finite].nan_to_num()) and not g[finite].isnan().any()
            assert same, f"{where}: infinities or NaNs where the reference has none, or none where it has them"
            err = torch.where(finite, (g - want).abs(), 0.0)
            off = err > bound
            if off.any():
                worst = int((err / bound).flatten().argmax())
                at = tuple(int(x) for x in torch.unravel_index(torch.tensor(worst), want.shape))
                raise AssertionError(
                    f"{where}: {int(off.sum())} of {want.numel()} elements off the float64 reference by more than "
                    f"float32 holds; the worst at {at}: {g.flatten()[worst]:.9g} against {want.flatten()[worst]:.9g}, "
                    f"bound {bound.flatten()[worst]:.3g}"
                )
        return self.margin(got)


def float64_reference(
    fn: Callable[..., torch.Tensor | Sequence[torch.Tensor | None]],
    *inputs,
    samples: int = SAMPLES,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Reference:
    """``fn`` on ``inputs`` (floating tensors taken to ``dtype``, their values exact; the rest as they
    are) in ``dtype``, and the bound a float32 result of it keeps to on these inputs (module doc)."""
    wide = [x.detach().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: every op passes this thread's dispatch
    try:
        generator = torch.Generator().manual_seed(seed)
        values = [v if v is None else v.detach() for v in _outputs(fn(*wide))]
        narrow = [str(v.dtype) for v in values if v is not None and v.dtype != dtype]
        if narrow:
            raise ValueError(
                f"the reference returns {', '.join(narrow)}, not {dtype}: convert its modules with .to({dtype})"
            )
        spread = [None if v is None else torch.zeros_like(v) for v in values]
        for _ in range(samples):
            with _Rounding(generator, dtype):
                runs = _outputs(fn(*wide))
            for s, r, v in zip(spread, runs, values):
                if s is not None:
                    s += (r.detach() - v).nan_to_num(nan=math.inf, posinf=math.inf, neginf=math.inf) ** 2
    finally:
        torch.set_num_threads(threads)
    return Reference(values, [None if v is None else _bound(v, s / samples) for v, s in zip(values, spread)])


def _bound(value: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """SPREADS times (the spread, a rounding of the element and one of the output's root mean square),
    and UNDERFLOW: an element that cancels to 0 in one order of sums keeps a rounding of its
    neighbours' size in another (attention's gradient for a query of one key: 0, or the rounding of
    p (dp - sum p dp) with the sum formed from the output)."""
    size = value.abs().nan_to_num(posinf=0.0, neginf=0.0)
    typical = size.square().mean().sqrt() if size.numel() else size.new_zeros(())
    return SPREADS * (variance.sqrt() + UNIT * (size + typical)) + UNDERFLOW
