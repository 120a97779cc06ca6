"""Predicted frames: AdamW's update rule turns a checkpoint's optimizer state into a forecast of the next one.

Where it sits: between the store and the codec. ``save`` asks :func:`plan` which float32 tensors of a state are
AdamW second moments (``exp_avg_sq``) and parameters, and which first moment (``exp_avg``) and second moment
each one pairs with (bfloat16 ones too: a tensor pairs only with tensors of its element type and shape). For a
changed chunk of such a tensor the store computes a prediction (:func:`predict`) from the parent's chunk at the
same position and the paired chunks, and the codec stores ``raw XOR prediction`` as a *predicted frame* (codec
4) that names those chunks and carries the coefficients. ``load`` decodes the named chunks first, recomputes the
same prediction and applies the frame. See ``docs/format.md``, "Predicted frames".

Why it works: with ``m``, ``v``, ``p`` the new first moment, second moment and parameter and primes for the
parent's, the gradient follows from the two first moments, ``g = (m - β1·m') / (1 - β1)``; then
``v = β2·v' + (1 - β2)·g²`` and ``p = A·p' - B·m / (√v + E)`` hold up to float32 rounding, so the residual is a
few low bits. ``m`` itself carries the step's new information and is stored as before. The parameter's
predictor recomputes ``v`` from ``v'`` rather than referencing this checkpoint's ``v``: both predicted tensors
then depend only on the parent's chunks and ``m``, so their chains stay as short as a second moment's.
Optimizers that keep a momentum buffer ``b`` (SGD, Nesterov SGD, RMSprop with momentum) step
``p = p' - lr·b`` (Nesterov: ``p' - lr·(1+μ)·b + lr·μ·b'``), so their parameters are predicted from ``b`` and
``b'`` the same way (the momentum-param predictor). An EMA copy of the weights, ``a = d·a' + (1-d)·p``, is that
predictor too, with this checkpoint's parameter as both references (an *average* role, found through the
parameters a :class:`~deltackpt.Checkpointer` names). Muon (``torch.optim.Muon``) steps a matrix by a bfloat16
update that nothing here can recompute, ``p = (1 - lr·wd)·p' - lr·k·u``: its parameters get the update-param
predictor, which rounds as torch does, with its reference an *update chunk* that the save makes of ``u``
(:func:`fit_update`), listed in no manifest.

Exactness is what makes this lossless: the prediction is a pure function of the stored coefficients and the
referenced chunks' bytes, computed by :func:`deltackpt.kernel.predict` (the native kernel's loops, or numpy in
the reference backend) with IEEE-754 float64 operations that are correctly rounded everywhere (one operation
each: ``+ - * / sqrt``; subnormal inputs read as zero), then rounded once to float32 (results below 2^-126
flushed to zero, NaN canonical; update-param rounds twice, as torch's two float32 steps do); bfloat16 elements
are widened to float32 first and the float32 result is rounded to bfloat16 (to nearest, ties to even). Encoder
and decoder therefore agree bit for bit on every machine, and which coefficients the encoder chose only changes
the residual's size. A wrong pairing or another optimizer costs one trial compression, never correctness.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltackpt import kernel, tree
from deltackpt._pykernel import adam_w
from deltackpt.errors import CorruptChunkError
from deltackpt.tree import child_path

#: predictor ids (prefix byte 0), named adam-v, adam-param and momentum-param in docs/format.md §8a
SECOND_MOMENT = 1  # refs: m, m' (base v'); coefs c0..c3: g = (m - c0*m') * c1 ; v = c2*v' + c3*(g*g)
PARAM = 2  # refs: m, m', v'; base p'; coefs c0..c6: g and w as v above, p = c4*p' - c5*(m / (sqrt(w) + c6))
MOMENTUM_PARAM = 3  # refs: b, b' (momentum buffers); base p'; coefs c0..c2: p = c0*p' - c1*b + c2*b'
#: AdamW's two over bfloat16 elements have this plus their id (adam-v-bf16 4, adam-param-bf16 5): the float32
#: predictor over the inputs widened, its result rounded to bfloat16. (Momentum-param has none: a bfloat16 SGD
#: weight's XOR delta is already as small as its prediction's residual.)
BF16 = 3
#: refs: u (an update chunk); base p'; coefs c0, c1: p = f32(c0*p') - c1*u, rounded once (Muon's step; frames v5)
UPDATE_PARAM = 6
_SHAPE = {SECOND_MOMENT: (2, 4), PARAM: (3, 7), MOMENTUM_PARAM: (2, 3), UPDATE_PARAM: (1, 2)}  # (refs, coefs)
_SHAPE.update({BF16 + SECOND_MOMENT: _SHAPE[SECOND_MOMENT], BF16 + PARAM: _SHAPE[PARAM]})
#: the first predictor that frames of version 2 (codec.PREDICTED_VERSION) cannot name: frames of it and later
#: ones are version 3, which readers that do not know them refuse as a newer format
FIRST_V3_PREDICTOR = MOMENTUM_PARAM
#: likewise the first predictor of version 4 frames (the bfloat16 predictors), and of version 5 (update-param)
FIRST_V4_PREDICTOR = BF16 + SECOND_MOMENT
FIRST_V5_PREDICTOR = UPDATE_PARAM
_PREFIX_HEAD = struct.Struct("<BBHI")  # predictor, refs, coefficients, reserved (0)
#: elements the encoder fits the parameter coefficients on (an evenly spaced sample of the chunk)
FIT_SAMPLE = 1 << 15


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a predicted frame records besides its residual: how to recompute the prediction."""

    predictor: int
    refs: tuple[bytes, ...]  # 16-byte digests of chunks with the frame's raw length, in the predictor's order
    coefs: tuple[float, ...]

    def pack(self) -> bytes:
        return (
            _PREFIX_HEAD.pack(self.predictor, len(self.refs), len(self.coefs), 0)
            + b"".join(self.refs)
            + struct.pack(f"<{len(self.coefs)}d", *self.coefs)
        )

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> Prediction:
        buf = bytes(buf)
        if len(buf) < _PREFIX_HEAD.size:
            raise CorruptChunkError(f"prediction record of {len(buf)} bytes is truncated")
        predictor, nrefs, ncoefs, reserved = _PREFIX_HEAD.unpack_from(buf)
        if predictor not in _SHAPE or (nrefs, ncoefs) != _SHAPE[predictor] or reserved != 0:
            raise CorruptChunkError(f"bad prediction record (predictor {predictor}, {nrefs} refs, {ncoefs} coefs)")
        if len(buf) != _PREFIX_HEAD.size + 16 * nrefs + 8 * ncoefs:
            raise CorruptChunkError(f"prediction record has {len(buf)} bytes for {nrefs} refs and {ncoefs} coefs")
        at = _PREFIX_HEAD.size
        refs = tuple(buf[at + 16 * i : at + 16 * (i + 1)] for i in range(nrefs))
        coefs = struct.unpack_from(f"<{ncoefs}d", buf, at + 16 * nrefs)
        if not valid_coefs(coefs):
            raise CorruptChunkError(f"prediction record has a coefficient out of range: {coefs}")
        return cls(predictor, refs, tuple(coefs))


#: Coefficients are 0 or of magnitude within [2^-60, 2^60]: the predictors' float64 intermediates then never
#: leave the normal range, so flush-to-zero settings cannot change a prediction (docs/format.md 8a).
COEF_MIN, COEF_MAX = 2.0**-60, 2.0**60


def element_predictor(predictor: int, width: int) -> int:
    """The id a frame records for a role's ``predictor`` (1-3) over elements of ``width`` bytes: itself for
    float32, its bfloat16 form for 2 (the only 2-byte elements :func:`plan` gives roles, adam-v and adam-param
    ones)."""
    return predictor + BF16 if width == 2 else predictor


def valid_coefs(coefs: Iterable[float]) -> bool:
    return all(c == 0.0 or COEF_MIN <= abs(c) <= COEF_MAX for c in coefs)


def _f64(buf: Any, step: int = 1, width: int = 4) -> np.ndarray:
    """Every ``step``-th float32 (``width`` 4) or bfloat16 (2) element of ``buf``, widened to float64 (a
    signalling NaN quietly: numpy's cast warns of it, and a state may hold one)."""
    raw = memoryview(buf).cast("B")
    with np.errstate(invalid="ignore"):
        if width == 2:
            return (np.frombuffer(raw, dtype="<u2")[::step].astype("<u4") << 16).view("<f4").astype(np.float64)
        return np.frombuffer(raw, dtype="<f4")[::step].astype(np.float64)


def predict(p: Prediction, base: Any, refs: list[Any], out: np.ndarray) -> None:
    """Write the prediction's bytes (float32, or bfloat16 for predictors 4 and 5) into ``out`` (uint8, the chunk's
    raw length).

    ``base`` is the raw bytes of the frame's base chunk (the parent's chunk at the same position), ``refs``
    those of ``p.refs`` in order. The kernel (:func:`deltackpt.kernel.predict`, native or the numpy reference)
    evaluates the predictor's definition (``docs/format.md`` §8a) one correctly rounded float64 operation at a
    time, so the result is the same bytes on every IEEE-754 machine and backend.
    """
    kernel.predict(p.predictor, p.coefs, base, refs, out)


def _sample(*bufs: Any, width: int = 4) -> list[np.ndarray]:
    """The same evenly spaced sample (at most about :data:`FIT_SAMPLE` elements) of each chunk of float32
    (``width`` 4) or bfloat16 (2) elements, in float64."""
    n = len(memoryview(bufs[0]).cast("B")) // width
    step = max(1, n // FIT_SAMPLE)
    return [_f64(b, step, width) for b in bufs]


def _fit_param(
    sample: Sequence[np.ndarray], moments: tuple[float, float, float, float], e: float, *, score: bool = True,
) -> tuple[tuple[float, ...] | None, float]:
    """Coefficients of the parameter predictor for one chunk: ``moments`` (c0..c3, see
    :func:`second_moment_coefs`), then A and B of ``p = A·p' - B·m / (√w + E)`` fitted by least squares on
    ``sample`` (:func:`_sample` of p', p, m, m', v': an evenly spaced sample of the chunk), then ``e`` (E); None
    when the chunk gives nothing to fit (no update, non-finite). And (``score``) how far the fitted prediction
    misses the sample (median relative error; else 0; infinite with None)."""
    po, pn, mm, m1, v1 = sample
    with np.errstate(all="ignore"):
        u = mm / (np.sqrt(adam_w(moments, mm, m1, v1)) + e)
        ok = np.isfinite(po) & np.isfinite(pn) & np.isfinite(u)
        if ok.sum() < 16:
            return None, np.inf
        x = np.stack([po[ok], -u[ok]], axis=1)
        sol, *_ = np.linalg.lstsq(x, pn[ok], rcond=None)
        miss = _miss(x @ sol, pn[ok]) if score else 0.0
    coefs = (*moments, float(sol[0]), float(sol[1]), e)
    return (coefs, miss) if valid_coefs(coefs) and coefs[5] != 0.0 else (None, np.inf)


def fit_momentum(po: np.ndarray, pn: np.ndarray, b: np.ndarray, b1: np.ndarray, *,
                 free_c2: bool = True) -> tuple[float, ...] | None:
    """Coefficients of the momentum-param predictor from samples (:func:`_sample` of p', p, b, b'): c0..c2 of
    ``p = c0·p' - c1·b + c2·b'`` fitted by least squares, with c2 = 0 (SGD, RMSprop: ``p = p' - lr·b``; an
    average, ``a = d·a' + (1-d)·p``, with c1 < 0) or, with ``free_c2``, free (Nesterov: ``p = p' - lr·(1+μ)·b +
    lr·μ·b'``), whichever misses the sample less. None when the chunk gives nothing to fit."""
    with np.errstate(all="ignore"):
        ok = np.isfinite(po) & np.isfinite(pn) & np.isfinite(b) & np.isfinite(b1)
        if ok.sum() < 16:
            return None
        cols = [po[ok], -b[ok], b1[ok]]
        best: tuple[tuple[float, ...] | None, float] = (None, np.inf)
        for k in (2, 3) if free_c2 else (2,):
            x = np.stack(cols[:k], axis=1)
            sol, *_ = np.linalg.lstsq(x, pn[ok], rcond=None)
            coefs = (float(sol[0]), float(sol[1]), float(sol[2]) if k == 3 else 0.0)
            if not valid_coefs(coefs) or coefs[1] == 0.0:
                continue
            miss = _miss(x @ sol, pn[ok])
            if miss < best[1]:
                best = (coefs, miss)
    return best[0]


def _miss(guess: np.ndarray, actual: np.ndarray) -> float:
    """Median relative error of ``guess`` (a sample of a prediction) against ``actual``."""
    with np.errstate(all="ignore"):
        rel = np.abs(guess - actual) / np.maximum(np.abs(actual), np.finfo(np.float32).tiny)
    rel = rel[np.isfinite(rel)]
    return float(np.median(rel)) if len(rel) else np.inf


def choose_coefs(role: Role, base: Any, new: Any, inputs: list[Any], width: int = 4) -> tuple[float, ...] | None:
    """The coefficients of one chunk's predicted frame: from the betas of the role's optimizer state and, when
    the checkpoint before held others (:attr:`Role.before`), those too, keeping whichever predicts a sample of
    the chunk better. A schedule that changes the betas (OneCycleLR cycles β1) has, by the time of the save,
    already set the next step's: the update the checkpoint holds used the ones saved before it.
    ``base`` is the parent's chunk, ``new`` this one, ``inputs`` the referenced chunks (m, m'[, v']), all of
    elements of ``width`` bytes (4: float32; 2: bfloat16). None when nothing predicts it."""
    if role.predictor == MOMENTUM_PARAM:
        return fit_momentum(*_sample(base, new, *inputs, width=width), free_c2=not role.average)
    options = [(role.beta1, role.beta2, role.eps)]
    if role.before is not None and role.before != options[0]:
        options.append(role.before)
    if role.predictor == SECOND_MOMENT and len(options) == 1:
        return second_moment_coefs(role.beta1, role.beta2)
    # one sample of each chunk for every option: p' (or v'), p (or v), m, m'[, v']
    sample = _sample(base, new, *inputs, width=width)
    best: tuple[tuple[float, ...] | None, float] = (None, np.inf)
    for beta1, beta2, eps in options:
        moments = second_moment_coefs(beta1, beta2)
        if moments is None:
            continue
        if role.predictor == SECOND_MOMENT:
            v1, vn, mm, m1 = sample
            with np.errstate(all="ignore"):
                got: tuple[tuple[float, ...] | None, float] = (moments, _miss(adam_w(moments, mm, m1, v1), vn))
        else:
            e = param_eps(dataclasses.replace(role, beta1=beta1, beta2=beta2, eps=eps))
            got = _fit_param(sample, moments, e, score=len(options) > 1)
        if got[0] is not None and (best[0] is None or got[1] < best[1]):
            best = got
    return best[0]


def second_moment_coefs(beta1: float, beta2: float) -> tuple[float, float, float, float] | None:
    """c0..c3 of the second-moment estimate for AdamW's betas; None when they are out of the coefficients' range."""
    coefs = (beta1, 1.0 / (1.0 - beta1), beta2, 1.0 - beta2)
    return coefs if valid_coefs(coefs) else None


@dataclass(frozen=True)
class Role:
    """How one tensor of a state can be predicted: from its first moment ``m`` (this checkpoint's and the
    parent's; for momentum-param, the momentum buffer) and, for an AdamW parameter, the parent's second moment
    ``v`` (key paths of the state). The betas, eps and step are AdamW's (unused by momentum-param)."""

    predictor: int
    m: str
    v: str | None  # the paired second moment (parameters only)
    beta1: float
    beta2: float
    eps: float
    step: float  # the optimizer step count after the update the checkpoint holds
    #: (β1, β2, eps) of this tensor's role in the checkpoint before, when the store knows them (see
    #: :func:`choose_coefs`; :func:`with_betas_before`)
    before: tuple[float, float, float] | None = None
    #: a momentum-param role whose ``m`` is a model parameter this tensor averages (an EMA copy of the weights,
    #: ``a = d·a' + (1-d)·p``): both references are this checkpoint's chunk of ``m`` (c2 = 0), which may itself be
    #: predicted, so these chunks are encoded after the parameter's (:func:`plan`)
    average: bool = False
    #: a momentum-param role of a Muon parameter (``torch.optim.Muon``): (lr, weight decay, the learning rate's
    #: factor for the matrix's shape) of its group. Muon steps ``p = (1 - lr·wd)·p' - lr·k·u``, with ``u`` its
    #: orthogonalized momentum in bfloat16, which nothing here can recompute: the save stores ``u`` as a chunk of
    #: its own (an *update chunk*) and predicts ``p`` from it (:func:`fit_update`).
    update: tuple[float, float, float] | None = None
    #: the learning rate of this tensor's Muon group in the checkpoint before (the one the update used, as a
    #: scheduler has set the next step's by the time of the save), where it differs (:func:`with_lr_before`)
    lr_before: float | None = None


def plan(state: Any, leaves: Iterable[Any], pairs: Mapping[str, str] | None = None) -> dict[str, Role]:
    """Find optimizer states that predict (``torch.optim`` state dicts whose entries hold ``exp_avg`` and
    ``exp_avg_sq``, or a ``momentum_buffer``) in ``state`` and return, by key path, the role of each predictable
    float32 tensor: every ``exp_avg_sq``, and each model parameter an optimizer state can be paired with. The same
    holds for bfloat16 tensors, with AdamW state only (:data:`BF16`); wherever "float32" and "shape" appear below,
    a tensor is compared with its form (:func:`_form`): it pairs only with tensors of its element type and shape.

    ``pairs`` maps the key path of an optimizer state entry (``optimizer.state[3]``) to its parameter's (what a
    :class:`~deltackpt.Checkpointer` knows from the objects); those are paired as given when the parameter is a
    float32 tensor of the state's shape. Next, an optimizer built from ``named_parameters()`` lists each parameter's
    name in its groups' ``param_names``: a state entry is paired with every float32 tensor of its shape outside
    optimizer states whose key path is that name or ends in ``.`` + name (``model.0.weight`` for ``0.weight``; an
    EMA copy saved as ``ema.0.weight`` is paired too, and its predictions stop being tried once they keep losing),
    both compared without the wrapper components of :data:`_WRAPPERS` (``module.`` of DistributedDataParallel,
    ``_orig_mod.`` of torch.compile, ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.`` of FSDP and
    activation checkpointing); state keyed by name names itself. Where a name matches too much, :func:`_pair_by_name`
    keeps the likely tensors or leaves the entry to the guess. Otherwise a parameter is paired with the i-th
    remaining optimizer state of its shape when it is the i-th of exactly as many remaining float32 tensors of that
    shape outside optimizer states (model state dicts list parameters in the optimizer's order); shapes with another
    count are left unpaired. Only performance depends on these guesses: a wrong pair gives a large residual, and the
    encoder then keeps another encoding.

    With ``pairs``, a float32 tensor outside optimizer states that averages a paired parameter (an EMA copy of
    the model: its key path, without wrapper components, ends in the parameter's name within its model, it has
    the parameter's shape, and it is the only such tensor) gets an average role (:attr:`Role.average`)."""
    roles, outside = _plan(state, list(leaves), pairs)
    if pairs:
        roles.update(_averages(outside, pairs, roles))
    return roles


def _averages(outside: list[Any], pairs: Mapping[str, str], roles: Mapping[str, Role]) -> dict[str, Role]:
    """The average roles of :func:`plan`: for each parameter ``pairs`` names (``model.blocks.0.weight``), the one
    float32 leaf of its shape, outside optimizer states and not a parameter or another role's tensor, whose
    unwrapped key path ends in ``.blocks.0.weight`` (``ema.module.blocks.0.weight`` of an ``AveragedModel``,
    ``extra.ema.blocks.0.weight``), or in a shorter tail of the name (down to two components) when none ends in
    the whole. A leaf two parameters claim is left alone. ``outside``: the float32 leaves outside optimizer
    states."""
    params = set(pairs.values())
    by_path = {leaf.path: leaf for leaf in outside}
    by_name = _by_name_suffix(leaf for leaf in outside if leaf.path not in params and leaf.path not in roles)
    found: list[tuple[str, str]] = []
    for p in sorted(params):
        leaf = by_path.get(p)
        if leaf is None or not _is_f32(leaf):  # (momentum-param: float32 only, see BF16)
            continue
        parts = _unwrapped(p).split(".")[1:]  # (the name within the model: the first component is the model's)
        # the longest name that some tensor's path ends in, down to two components (one for a one-part name):
        # ``net.blocks.0.weight`` of a ModuleDict whose copy is ``model.ema.module.blocks.0.weight``
        for j in range(max(1, len(parts) - 1)):
            cands = [c for c in by_name.get(".".join(parts[j:]), ()) if _form(c) == _form(leaf)]
            if cands:
                if len(cands) == 1:
                    found.append((cands[0].path, p))
                break
    claimed = Counter(a for a, _ in found)
    return {a: Role(MOMENTUM_PARAM, p, None, 0.0, 0.0, 0.0, 0.0, average=True) for a, p in found if claimed[a] == 1}


def _plan(state: Any, leaves: list[Any], pairs: Mapping[str, str] | None) -> tuple[dict[str, Role], list[Any]]:
    """:func:`plan` without the average roles, and the float32 leaves outside optimizer states."""
    by_path = {leaf.path: leaf for leaf in leaves}
    roles: dict[str, Role] = {}
    optimizers = list(_optimizer_dicts(state, ""))
    optimizer_prefixes = {path for path, _ in optimizers}
    outside = [leaf for leaf in leaves if _form(leaf) and not _inside_any(leaf.path, optimizer_prefixes)]
    by_name: dict[str, list[Any]] | None = None  # leaves outside optimizer states, by each name they end in
    states: list[tuple[Form, Role]] = []  # (form, role its parameter would take) still unpaired
    # state entries with a name: (optimizer number, shape, role, (prefix, leaf) of each leaf the name matches)
    named_states: list[tuple[int, Form, Role, list[tuple[str, Any]]]] = []
    for o, (path, opt) in enumerate(optimizers):
        spath = child_path(path, "state")
        for group in opt["param_groups"]:
            idxs = group.get("params") if isinstance(group, Mapping) else None
            if not isinstance(idxs, (list, tuple)):
                continue
            names = group.get("param_names")
            if names is None and all(isinstance(i, str) for i in idxs):
                names = idxs  # state keyed by parameter name (torch.distributed.checkpoint's optimizer state dict)
            if not (isinstance(names, (list, tuple)) and len(names) == len(idxs)
                    and all(isinstance(n, str) and n for n in names)):
                names = [None] * len(idxs)
            elif by_name is None:
                by_name = _by_name_suffix(outside)
            for idx, name in zip(idxs, names):
                if not isinstance(idx, (int, str)):
                    continue
                base = child_path(spath, idx)
                found = _param_role(opt["state"].get(idx), group, base, by_path)
                if found is None:
                    continue
                form, prole, others = found
                roles.update(others)
                given = by_path.get((pairs or {}).get(base, ""))
                if given is not None and _form(given) == form and given.path not in roles:
                    roles[given.path] = prole
                    continue
                if name is None or by_name is None:
                    states.append((form, prole))
                    continue
                plain = _unwrapped(name)
                matches = [(_unwrapped(leaf.path)[: -len(plain)], leaf) for leaf in by_name.get(plain, ())
                           if _form(leaf) == form]
                named_states.append((o, form, prole, matches))
    states += _pair_by_name(named_states, roles)
    if not states:
        return roles, outside
    params: dict[Form, list[str]] = {}
    for leaf in outside:
        if leaf.path not in roles and (leaf_form := _form(leaf)):
            params.setdefault(leaf_form, []).append(leaf.path)
    per_form: dict[Form, list[Role]] = {}
    for form, prole in states:
        per_form.setdefault(form, []).append(prole)
    for form, proles in per_form.items():
        cands = params.get(form, [])
        if len(cands) == len(proles):
            roles.update(zip(cands, proles))
    return roles, outside


def plan_flat(leaves: Iterable[Any], flat: Mapping[str, Any], under: str) -> dict[str, Role]:
    """Roles for a state that torch.distributed.checkpoint flattened: the leaves under ``under`` are keyed
    ``fqn@offsets`` (a rank's shards, :mod:`deltackpt.distributed`), and ``flat`` is DCP's whole flattened state
    on this rank (every rank holds it, also the items another rank writes), where an Adam optimizer saved under
    ``<prefix>`` lists ``<prefix>.state.<param>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` and its groups'
    ``<prefix>.param_groups.<g>.params`` (parameter names, or numbers with ``param_names``), ``.betas`` and
    ``.eps`` (an optimizer saved at the top, ``dcp.save(opt.state_dict())``, has the prefix ""). Each
    ``exp_avg_sq`` shard gets the adam-v role, and, when the parameter has a name, each float32 shard of the same
    offsets and shape outside the optimizer state whose fqn is that name or ends in ``.`` + name (without wrapper
    components) the adam-param role; likewise a ``momentum_buffer`` shard (SGD or RMSprop with momentum) gives
    such shards the momentum-param role. As with :func:`plan`, only performance depends on these pairings."""
    lead = under + "."
    shards: dict[str, Any] = {}  # "fqn@offsets" -> leaf
    for leaf in leaves:
        if leaf.path.startswith(lead) and _form(leaf):
            shards[leaf.path[len(lead):]] = leaf
    # (optimizer prefix, "" for one saved at the top, and param id) -> (the parameter's name or None, its group)
    groups: dict[tuple[str, str], tuple[str | None, Mapping[str, Any]]] = {}
    for key, ids in flat.items():
        head, sep, tail = key.rpartition(".params")
        if tail or not sep or not isinstance(ids, (list, tuple)):
            continue
        prefix, sep, g = ("." + head).rpartition(".param_groups.")
        if not sep:
            continue
        group: Mapping[str, Any] = {name: flat.get(f"{head}.{name}") for name in ("betas", "eps")
                                    if f"{head}.{name}" in flat}
        names = flat.get(f"{head}.param_names")
        if not (isinstance(names, (list, tuple)) and len(names) == len(ids)):
            names = ids  # state keyed by name (get_state_dict), or by number without names: second moments only
        for i, name in zip(ids, names):
            if isinstance(i, (int, str)):
                groups[(prefix[1:], str(i))] = (name if isinstance(name, str) and name else None, group)
    by_name: dict[tuple[str, str], list[str]] | None = None  # (unwrapped name suffix, offsets) -> param shards

    def params(name: str, off: str, form: Form | None, own: str) -> list[Any]:
        """The shards of ``form`` outside optimizer prefix ``own`` of parameter ``name`` at offsets ``off``."""
        nonlocal by_name
        if by_name is None:
            by_name = {}
            for k in shards:
                f, _, o = k.rpartition("@")
                parts = _unwrapped(f).split(".")
                for j in range(len(parts)):
                    by_name.setdefault((".".join(parts[j:]), o), []).append(k)
        return [shards[k] for k in by_name.get((_unwrapped(name), off), ())
                if _form(shards[k]) == form and not k.startswith(own) and shards[k].path not in roles]

    def entry(base: str) -> tuple[str, str | None, Mapping[str, Any]] | None:
        """(the optimizer's state prefix, parameter name or None, group) of the optimizer state entry at
        ``base`` (the prefix's shards, the optimizer's own, pair with nothing)."""
        dotted = "." + base  # (an optimizer saved at the top has keys "state.<param>...")
        at = next((i for i in range(len(dotted)) if dotted.startswith(".state.", i)
                   and (dotted[1:i], dotted[i + 7:]) in groups), None)
        if at is None:
            return None
        return (dotted[1:at + 7], *groups[(dotted[1:at], dotted[at + 7:])])

    roles: dict[str, Role] = {}
    for key, vl in shards.items():
        fqn, _, off = key.rpartition("@")
        if fqn.endswith(".momentum_buffer"):  # SGD (or RMSprop) with momentum: the parameter's step is -lr·b
            found = entry(fqn[: -len(".momentum_buffer")])
            if found is not None and found[1] is not None and _is_f32(vl):  # (float32 only: see BF16)
                for leaf in params(found[1], off, _form(vl), found[0]):
                    roles[leaf.path] = Role(MOMENTUM_PARAM, vl.path, None, 0.0, 0.0, 0.0, 0.0)
            continue
        if not fqn.endswith(".exp_avg_sq"):
            continue
        base = fqn[: -len(".exp_avg_sq")]
        ml = shards.get(f"{base}.exp_avg@{off}")
        if ml is None or _form(ml) != _form(vl):
            continue
        found = entry(base)
        if found is None:
            continue
        own, name, group = found
        betas = _group_betas(group)
        if betas is None:
            continue
        try:
            step = float(flat.get(f"{base}.step", 0))
        except (TypeError, ValueError, RuntimeError, OverflowError):
            step = 0.0
        mp, vp = ml.path, vl.path
        roles[vp] = Role(SECOND_MOMENT, mp, None, *betas, step)
        if name is not None:
            for leaf in params(name, off, _form(vl), own):
                roles[leaf.path] = Role(PARAM, mp, vp, *betas, step)
    return roles


def _param_role(st: Any, group: Mapping[str, Any], base: str, by_path: Mapping[str, Any]
                ) -> tuple[Form, Role, dict[str, Role]] | None:
    """For one optimizer state entry ``st`` (at key path ``base``, in parameter group ``group``): the form
    (:func:`_form`) its parameter has, the role that parameter takes, and the roles of the entry's own tensors (an AdamW
    second moment); None when the entry predicts nothing.

    AdamW-style entries (``exp_avg`` and ``exp_avg_sq``) give the parameter an adam-param role and the second
    moment an adam-v role. Entries with a ``momentum_buffer`` (SGD with momentum, RMSprop with momentum) give
    the parameter a momentum-param role: their step is ``p = p' - lr·b`` (Nesterov: also a ``b'`` term)."""
    if not isinstance(st, Mapping):
        return None
    if "exp_avg" in st and "exp_avg_sq" in st:
        betas = _group_betas(group)
        mp, vp = child_path(base, "exp_avg"), child_path(base, "exp_avg_sq")
        ml, vl = by_path.get(mp), by_path.get(vp)
        form = None if ml is None or vl is None else _form(vl)
        if betas is None or form is None or _form(ml) != form:
            return None
        try:
            step = float(st.get("step", 0))
        except (TypeError, ValueError, RuntimeError, OverflowError):
            step = 0.0
        v = Role(SECOND_MOMENT, mp, None, *betas, step)
        return form, Role(PARAM, mp, vp, *betas, step), {vp: v}
    if "momentum_buffer" in st:
        bp = child_path(base, "momentum_buffer")
        form = None if (bl := by_path.get(bp)) is None or not _is_f32(bl) else _form(bl)  # (float32 only: BF16)
        if form is None:
            return None
        if _is_muon(group):
            update = _muon_update(group, form[1])
            if update is None:
                return None
            return form, Role(MOMENTUM_PARAM, bp, None, 0.0, 0.0, 0.0, 0.0, update=update), {}
        return form, Role(MOMENTUM_PARAM, bp, None, 0.0, 0.0, 0.0, 0.0), {}
    return None


def _is_muon(group: Mapping[str, Any]) -> bool:
    """Whether a parameter group is ``torch.optim.Muon``'s (it alone has Newton-Schulz coefficients)."""
    return "ns_coefficients" in group and "adjust_lr_fn" in group


def _muon_update(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[float, float, float] | None:
    """:attr:`Role.update` of a matrix of ``shape`` in Muon group ``group``: its lr, weight decay and the factor
    Muon multiplies lr by for the shape (``torch.optim._muon._adjust_lr``); None when they are not numbers."""
    if len(shape) != 2:
        return None
    try:
        lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))
    except (TypeError, ValueError, KeyError, RuntimeError, OverflowError):
        return None
    a, b = shape
    fn = group.get("adjust_lr_fn")
    if fn is None or fn == "original":
        ratio = math.sqrt(max(1, a / b)) if b else 1.0
    elif fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(a, b))
    else:
        ratio = 1.0
    return (lr, wd, ratio) if math.isfinite(lr) and math.isfinite(wd) else None


def fit_update(role: Role, base: Any, new: Any) -> tuple[tuple[float, float], np.ndarray] | None:
    """The update-param coefficients and the update chunk of a Muon parameter's chunk (:attr:`Role.update`):
    ``new`` is the chunk, ``base`` the parent's (float32 bytes). Muon computed ``p = f32(f32(c0·p') - c1·u)``
    (``mul_`` by c0 = f32(1 - lr·wd), then ``add_`` of its bfloat16 result ``u`` times -c1 = -f32(lr·k), which
    torch fuses into one rounding), so ``u`` is the bfloat16 number nearest to ``(f32(c0·p') - p) / c1``, and
    the update-param predictor, the same two steps, gives back every element (where torch did not fuse the last
    step, about 86%). Of the learning rates of :attr:`Role.lr_before` and the group's, the one whose
    coefficients predict an evenly spaced sample best is taken. Returns ((c0, c1), u as float32: 0 where not
    finite), or None when neither predicts half of the sample exactly (another optimizer step than Muon's, saves
    further apart)."""
    assert role.update is not None
    lr, wd, ratio = role.update
    old = np.frombuffer(memoryview(base).cast("B"), dtype="<f4")
    cur = np.frombuffer(memoryview(new).cast("B"), dtype="<f4")
    step = max(1, len(cur) // FIT_SAMPLE)
    so, sn = old[::step], cur[::step]
    best: tuple[float, np.float32, np.float32] | None = None
    for rate in dict.fromkeys(r for r in (role.lr_before, lr) if r is not None):
        c0, c1 = np.float32(1.0 - rate * wd), np.float32(rate * ratio)
        if c1 == 0 or not valid_coefs((float(c0), float(c1))):
            continue
        guess = np.empty(len(so), dtype="<f4")
        kernel.predict(UPDATE_PARAM, (float(c0), float(c1)), np.ascontiguousarray(so), [_update_of(so, sn, c0, c1)],
                       guess.view(np.uint8))
        hits = float(np.mean(guess.view("<u4") == sn.view("<u4"))) if len(sn) else 0.0
        if best is None or hits > best[0]:
            best = (hits, c0, c1)
    if best is None or best[0] < 0.5:
        return None
    _, c0, c1 = best
    return (float(c0), float(c1)), _update_of(old, cur, c0, c1)


def _update_of(old: np.ndarray, new: np.ndarray, c0: np.float32, c1: np.float32) -> np.ndarray:
    """``u = bf16((f32(c0·p') - p) / c1)`` elementwise, as float32 (round to nearest, ties to even); 0 where
    that is not finite."""
    with np.errstate(all="ignore"):
        q = ((old * c0).astype(np.float64) - new) / np.float64(c1)
        q32 = q.astype(np.float32)
    bits = q32.view("<u4")
    u = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view("<f4")
    u[~np.isfinite(q32) | ~np.isfinite(u)] = 0.0
    return u


def _pair_by_name(named_states: list[tuple[int, Form, Role, list[tuple[str, Any]]]],
                  roles: dict[str, Role]) -> list[tuple[Form, Role]]:
    """Pair the state entries whose parameters an optimizer names (``(optimizer number, shape, role,
    [(prefix, leaf)])``: every float32 leaf of the shape whose unwrapped key path is ``prefix`` + the name) and
    return those left for the shape guess.

    A name can match more leaves than its parameter: ``0.weight`` matches ``model.0.weight`` and
    ``model.1.0.weight``; two models trained by two optimizers have the same names. So each optimizer keeps only
    the prefixes that match the most of its names (``model.``; several when they tie: the model and an EMA copy
    of it), and a leaf that two entries' names both claim (two models trained by one or two optimizers, named
    by their own modules) is paired by neither: their entries go to the shape guess, as without names."""
    votes: dict[int, dict[str, int]] = {}
    for o, _, _, matches in named_states:
        for prefix in {prefix for prefix, _ in matches}:
            votes.setdefault(o, {})[prefix] = votes.get(o, {}).get(prefix, 0) + 1
    best = {o: {p for p, n in v.items() if n == max(v.values())} for o, v in votes.items()}
    chosen = [[leaf for prefix, leaf in matches if prefix in best.get(o, ())] for o, _, _, matches in named_states]
    claims: Counter[str] = Counter(leaf.path for leaves in chosen for leaf in leaves)
    left = []
    for (_, form, prole, _), leaves in zip(named_states, chosen):
        mine = [leaf for leaf in leaves if claims[leaf.path] == 1 and leaf.path not in roles]
        for leaf in mine:
            roles[leaf.path] = prole
        if not mine:
            left.append((form, prole))
    return left


def _group_betas(group: Mapping[str, Any]) -> tuple[float, float, float] | None:
    """(β1, β2, eps) of an Adam-style parameter group (torch's defaults where it names none); None when they
    are not usable numbers."""
    betas = group.get("betas", (0.9, 0.999))
    try:
        beta1, beta2 = float(betas[0]), float(betas[1])
        eps = float(group.get("eps", 1e-8))
    except (TypeError, ValueError, IndexError, KeyError, RuntimeError, OverflowError):
        return None
    return (beta1, beta2, eps) if 0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 else None


#: module names that wrappers put into parameter names and state dict keys (DistributedDataParallel,
#: torch.compile, FSDP, activation checkpointing): names are compared without them
_WRAPPERS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _unwrapped(name: str) -> str:
    """``name`` without the components that wrappers add: ``module._orig_mod.0.weight`` -> ``0.weight``."""
    parts = name.split(".")
    return ".".join(p for p in parts if p not in _WRAPPERS) if _WRAPPERS.intersection(parts) else name


def _by_name_suffix(leaves: Iterable[Any]) -> dict[str, list[Any]]:
    """Leaves by every name their key path, without wrapper components (:func:`_unwrapped`), ends in at a
    ``.``: ``model.module.0.weight`` under ``model.0.weight``, ``0.weight`` and ``weight``. Look names up
    unwrapped too."""
    out: dict[str, list[Any]] = {}
    for leaf in leaves:
        path = _unwrapped(leaf.path)
        out.setdefault(path, []).append(leaf)
        at = path.find(".")
        while at >= 0:
            out.setdefault(path[at + 1 :], []).append(leaf)
            at = path.find(".", at + 1)
    return out


#: (β1, β2, eps) as a parent checkpoint's skeleton holds them; None for one that is not a plain number there
#: (a tensor: the current value stands in for it)
Betas = tuple[float | None, float | None, float | None]


def betas_in_skeleton(skeleton: Any) -> dict[str, Betas]:
    """(β1, β2, eps) of each optimizer state's parameter group in a checkpoint's skeleton (its manifest's
    tree, tensors left as references), by the key path of the state's ``exp_avg``: what a save hands to
    :func:`with_betas_before` for its parent. Only each group's ``betas``, ``eps`` and ``params`` nodes are
    read, element by element: a tensor ``lr`` beside them does not matter, and a tensor β2 or eps reads as None
    (β1 is what schedulers change). A group whose values cannot be read is skipped."""
    out: dict[str, Betas] = {}
    for entries, nodes in _skeleton_groups(skeleton):
        values = [_plain_float(n) for _, n in tree.node_children(nodes.get("betas"))][:2]
        if len(values) != 2 or values[0] is None:
            continue
        betas: Betas = (values[0], values[1], _plain_float(nodes["eps"]) if "eps" in nodes else 1e-8)
        for entry in entries:
            out[child_path(entry, "exp_avg")] = betas
    return out


def _skeleton_groups(skeleton: Any) -> Iterable[tuple[list[str], dict[Any, Any]]]:
    """(key paths of its state entries, its nodes by key) of each parameter group of each optimizer state dict
    in a checkpoint's skeleton; groups whose ``params`` node is missing or not a plain list are left out."""
    for path, groups_node in _skeleton_optimizers(skeleton, ""):
        spath = child_path(path, "state")
        for _, group_node in tree.node_children(groups_node):
            nodes = dict(tree.node_children(group_node))
            try:
                idxs = tree.decode_plain(nodes["params"])
            except Exception:  # missing, or not plain
                continue
            if isinstance(idxs, (list, tuple)):
                ids = [i for i in idxs if isinstance(i, (int, str)) and not isinstance(i, bool)]
                yield [child_path(spath, i) for i in ids], nodes


def _plain_float(node: Any) -> float | None:
    """The number a skeleton node holds, or None when it holds something else (a tensor, a string)."""
    try:
        value = tree.decode_plain(node)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    except Exception:
        return None


def _skeleton_optimizers(n: Any, path: str) -> Iterable[tuple[str, Any]]:
    """(key path, ``param_groups`` node) of each optimizer state dict in a skeleton, found as
    :func:`_optimizer_dicts` finds them in a state."""
    kids = tree.node_children(n)
    if tree.is_dict_node(n):
        nodes = dict(kids)
        if tree.is_sequence_node(nodes.get("param_groups")) and tree.is_dict_node(nodes.get("state")):
            yield path, nodes["param_groups"]
            return
    for k, v in kids:
        if isinstance(k, (str, int)):
            yield from _skeleton_optimizers(v, child_path(path, k))


def with_betas_before(roles: Mapping[str, Role], before: Mapping[str, Betas]) -> dict[str, Role]:
    """``roles`` with the betas the parent checkpoint held for each role's first moment
    (:func:`betas_in_skeleton`; the current value where it held none it could read) where they differ."""
    out = dict(roles)
    for path, r in roles.items():
        got = before.get(r.m)
        if got is None:
            continue
        now = (r.beta1, r.beta2, r.eps)
        beta1, beta2, eps = (x if x is not None else y for x, y in zip(got, now))
        if (beta1, beta2, eps) != now and 0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0:
            out[path] = dataclasses.replace(r, before=(beta1, beta2, eps))
    return out


def lrs_in_skeleton(skeleton: Any) -> dict[str, float]:
    """The learning rate of each Muon parameter group (:func:`_is_muon`) in a checkpoint's skeleton, by the key
    path of its states' ``momentum_buffer``: what :func:`with_lr_before` reads for a save's parent. A group whose
    lr is not a plain number there (a tensor) is skipped."""
    out: dict[str, float] = {}
    for entries, nodes in _skeleton_groups(skeleton):
        if _is_muon(nodes) and "lr" in nodes and (lr := _plain_float(nodes["lr"])) is not None:
            out.update((child_path(entry, "momentum_buffer"), lr) for entry in entries)
    return out


def with_lr_before(roles: Mapping[str, Role], skeleton: Any) -> dict[str, Role]:
    """``roles`` with :attr:`Role.lr_before` set from the parent checkpoint's skeleton where a Muon group's
    learning rate differs there (a scheduler's); the skeleton is read only when some role is a Muon one."""
    out = dict(roles)
    if not any(r.update is not None for r in roles.values()):
        return out
    before = lrs_in_skeleton(skeleton)
    for path, r in roles.items():
        lr = before.get(r.m)
        if r.update is not None and lr is not None and lr != r.update[0]:
            out[path] = dataclasses.replace(r, lr_before=lr)
    return out


def param_eps(role: Role) -> float:
    """E of the parameter predictor: ``eps·√(1 - β2^t)`` (torch divides √v by that root instead)."""
    if role.step >= 1:
        return role.eps * float(np.sqrt(1.0 - role.beta2**role.step))
    return role.eps


def _optimizer_dicts(obj: Any, path: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    if isinstance(obj, Mapping):
        if isinstance(obj.get("state"), Mapping) and isinstance(obj.get("param_groups"), (list, tuple)):
            yield path, obj
            return
        for k, v in obj.items():
            if isinstance(k, (str, int)):
                yield from _optimizer_dicts(v, child_path(path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _optimizer_dicts(v, child_path(path, i))


def _inside_any(path: str, prefixes: Set[str]) -> bool:
    """Whether ``path`` is one of ``prefixes`` or lies under one (``prefix.`` or ``prefix[`` follows), in time
    linear in the path, not in the number of prefixes (a state may hold one optimizer per parameter)."""
    if not prefixes:  # (a state without optimizer state: nothing to walk the path for)
        return False
    if "" in prefixes or path in prefixes:
        return True
    return any(c in ".[" and path[:i] in prefixes for i, c in enumerate(path))


#: what a tensor must share with the tensors it is paired with: its element type and its shape (:func:`_form`)
Form = tuple[str, tuple[int, ...]]


def _form(leaf: Any) -> Form | None:
    """``(element type, shape)`` of a leaf whose elements predictors compute (float32 or bfloat16), else None."""
    if leaf.dtype in ("float32", "<f4") and leaf.width == 4:
        return "float32", tuple(leaf.shape)
    if leaf.dtype == "bfloat16" and leaf.width == 2:
        return "bfloat16", tuple(leaf.shape)
    return None


def _is_f32(leaf: Any) -> bool:
    """Whether a leaf's elements are float32 (the only ones momentum-param predicts: see :data:`BF16`)."""
    return (_form(leaf) or ("",))[0] == "float32"
