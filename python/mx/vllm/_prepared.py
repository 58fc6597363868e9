"""A second, processed set of one vLLM rank's weights, built while vLLM generates, and its
exchange with the live set at the safe point (issue 33; see docs/notes/issue33-plan.md).

vLLM's layerwise reload (``vllm/model_executor/model_loader/reload``) runs the model's weight
loaders and each layer's post-load processing (``quant_method.process_weights_after_loading``:
on a CPU, the GEMM weights packed into kernel handles held by ``layer.cpu_linear``) on the live
layers, which sit on the meta device meanwhile: it can only run paused. :class:`Prepared` runs
the same code on *shadow* layers instead: each module is copied (its own ``__dict__``,
``_parameters``, ``_buffers`` and ``quant_method``), its tensors materialized afresh from the
metadata vLLM recorded at start-up (``record_metadata_for_reloading``: the shapes and weight
loaders before processing), each when a loader first writes it, with the loaders rebound to
the shadow, parameters shared between
modules (a tied ``lm_head``) shared between their shadows. Loading and processing then touch
only the shadows, so the engine keeps generating on the live set.

:meth:`Prepared.exchange` swaps, module by module, everything the shadow's build changed
(``_parameters``, ``_buffers`` and each attribute that processing set, such as ``cpu_linear``)
with the live module's: afterwards the live modules compute with the new version, and the
shadows hold the old one, so calling it again is the rollback. Nothing is copied in the pause.
It swaps Python objects: for an engine that captured tensor addresses (CUDA graphs, a compiled
graph with frozen weights) the processed values must be copied into the live tensors instead:
``exchange(in_place=True)`` (after :meth:`Prepared.plan_in_place`) swaps the bytes of every live
tensor with its shadow's, so each live tensor keeps its address (``data_ptr``) and the shadows
again hold the old version. That needs a processed form made of tensors of the live ones'
shapes (vLLM's unquantized GPU layers; vLLM's CPU layers hold packed GEMM handles instead,
which :meth:`Prepared.plan_in_place` refuses, naming the first).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable
from types import MethodType
from typing import Any

import torch

from .. import _failpoints
from ._layout import _stack_key

_NEVER_SWAPPED = frozenset({"_modules", "training"})
"""Module attributes left alone by the exchange: the tree itself (each shadow's children are
shadows) and the train/eval flag."""


class Prepared:
    """The shadow of a vLLM model (see the module docs). Build with :meth:`build`; then
    :meth:`exchange` at the safe point (again to roll back)."""

    def __init__(self, root: torch.nn.Module, pairs: list[tuple[str, Any, Any, frozenset[str]]]):
        """``root``: the shadow model; ``pairs``: ``(module name, live module, its shadow, the
        attributes an exchange swaps)``, in the model's module order."""
        self.root = root
        self._pairs = pairs
        self._in_place: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        model_config: Any,
        device: torch.device,
        windows: Iterable[Iterable[tuple[str, torch.Tensor]]],
    ) -> Prepared:
        """Shadows of ``model``'s modules loaded from ``windows`` (groups of checkpoint tensors,
        as ``model.load_weights`` takes them) and processed as vLLM processes a fresh load. The
        live model is not touched.

        A shadow tensor is allocated when a loader first writes it (its placeholder, on the meta
        device until then, carries a loader that materializes it: vLLM's layerwise reload does
        the same), and a window whose tensors all belong to whole decoder layers
        (``...layers.<k>.``, as :func:`mx.vllm._layout.layer_windows` cuts them) has those
        layers' modules processed as soon as it is loaded (their quant methods: CPU GEMM
        packing, MoE experts), as that reload does: the unpacked form of one layer at a time
        exists beside the packed ones, and the memory one layer's unpacked form freed is the
        next one's. Everything else (attention layers, the embeddings and a tied head,
        model-level hooks) is processed by vLLM's own ``process_weights_after_loading`` at the
        end; a tensor no loader wrote is allocated before its processing.

        Raises:
            RuntimeError: vLLM recorded no reload metadata for the model (a vLLM older than
                its layerwise reload), or a layer's loaders or processing failed (the live model
                is unchanged; the shadows are dropped).
        """
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        before: dict[int, dict[str, Any]] = {}
        shadows = _Shadows(device)
        root = shadows.of(model, before)
        # The tree is made: its tensors are held by their modules only from here (vLLM's
        # processing frees each unpacked tensor it repacks as soon as it is done with it).
        shadows.tensors.clear()
        done: list[torch.nn.Module] = []
        with torch.no_grad():
            for window in windows:
                names: list[str] = []
                root.load_weights(_noting(window, names))
                layers = _whole_layers(names)
                shadows.materialize_under(layers)
                done += _process_layers(root, layers, device, done)
            shadows.materialize_under({""})
        with _hidden_quant_methods(done):
            process_weights_after_loading(root, model_config, device)
        pairs = []
        for (name, live), shadow in zip(model.named_modules(), root.modules(), strict=True):
            # The live module's attributes when the shadow was made: the shadow differs from
            # them where it has its own tensors and quant method, and where loading and
            # processing set something (later changes to the live module are not undone).
            was = before[id(shadow)]
            changed = {
                k
                for k in set(shadow.__dict__) | set(was)
                if k not in _NEVER_SWAPPED
                and (k not in was or k not in shadow.__dict__ or shadow.__dict__[k] is not was[k])
            }
            if changed:
                pairs.append((name, live, shadow, frozenset(changed)))
        return cls(root, pairs)

    @property
    def module_pairs(self) -> int:
        """How many (live, shadow) module pairs an exchange swaps."""
        return len(self._pairs)

    def plan_in_place(self) -> int:
        """Pairs every live tensor that the build changed with its shadow, each once (a tensor
        two modules share, such as a tied ``lm_head``'s, once), for ``exchange(in_place=True)``;
        returns how many pairs. Attributes other than tensors (dicts, lists and the quant
        method's state are looked into) must be the live ones or equal to them.

        Raises:
            ValueError: naming the module attribute whose processed form is not a tensor of the
                live one's shape, dtype and device (a packed kernel handle, a repacked or
                resized weight, a tensor on the meta device): such a set can only be exchanged
                as objects. Nothing is changed.
        """
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        for name, live, shadow, keys in self._pairs:
            for k in sorted(keys):
                where = f"{name or '<model>'}.{k}"
                lv, sv = live.__dict__.get(k, _ABSENT), shadow.__dict__.get(k, _ABSENT)
                for a, b in _tensor_pairs(lv, sv, where, 0):
                    key = (a.data_ptr(), tuple(a.shape), tuple(a.stride()))
                    if key not in seen:
                        seen.add(key)
                        pairs.append((a, b))
        self._in_place = pairs
        return len(pairs)

    def exchange(self, failpoint: tuple[str, int] | None = None, in_place: bool = False) -> None:
        """Swaps the prepared state with the live one (in the pause: no loaders). Called again,
        swaps back. All or nothing: when a swap fails the ones done so far are swapped back
        before the error propagates.

        ``in_place=False``: module by module, the objects (no copies). ``in_place=True``: the
        bytes of each tensor pair of :meth:`plan_in_place` (three copies per pair through one
        transient tensor; each live tensor keeps its address).

        ``failpoint`` (tests, :mod:`mx._failpoints`): fail after that many module pairs (tensor
        pairs in place).

        Raises:
            RuntimeError: ``in_place`` before :meth:`plan_in_place`; the failpoint's error.
        """
        if in_place:
            if self._in_place is None:
                raise RuntimeError("mx: exchange(in_place=True) needs plan_in_place() first")
            _all_or_nothing(self._in_place, _swap_bytes, failpoint)
        else:
            _all_or_nothing(self._pairs, _swap, failpoint)


def _noting(
    window: Iterable[tuple[str, torch.Tensor]], names: list[str]
) -> Iterable[tuple[str, torch.Tensor]]:
    """``window`` as it is, each name appended to ``names`` as it passes."""
    for name, t in window:
        names.append(name)
        yield name, t


def _whole_layers(names: list[str]) -> set[str]:
    """The decoder-layer prefixes (``model.layers.3.``) of a window's checkpoint names, when
    every name has one (else none: such a window is processed at the end)."""
    found = [_stack_key(n) for n in names]
    if not found or None in found:
        return set()
    return {f"{stack}.{index}." for stack, index in found if stack}


def _process_layers(
    root: torch.nn.Module, prefixes: set[str], device: torch.device, done: list[Any]
) -> list[torch.nn.Module]:
    """Runs the quant method's ``process_weights_after_loading`` of every module under
    ``prefixes`` (not yet processed, not an attention layer, whose processing waits for the
    end), as vLLM's ``process_weights_after_loading`` does module by module; returns them."""
    if not prefixes:
        return []
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.utils import device_loading_context

    seen = {id(m) for m in done}
    out = []
    for name, module in root.named_modules():
        if not any(name.startswith(p) for p in prefixes) or id(module) in seen:
            continue
        method = getattr(module, "quant_method", None)
        if not isinstance(method, QuantizeMethodBase) or is_deferred_attention_layer(module):
            continue
        with device_loading_context(module, device):
            method.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()
        out.append(module)
    return out


class _hidden_quant_methods:
    """Within it, each module given has no ``quant_method`` that vLLM's processing would run
    (an instance attribute ``None`` over its own, restored on exit)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules
        self.saved: list[tuple[torch.nn.Module, Any]] = []

    def __enter__(self) -> None:
        for m in self.modules:
            self.saved.append((m, m.__dict__.get("quant_method", _ABSENT)))
            m.__dict__["quant_method"] = None

    def __exit__(self, *exc: Any) -> None:
        for m, v in self.saved:
            if v is _ABSENT:
                del m.__dict__["quant_method"]
            else:
                m.__dict__["quant_method"] = v


def _all_or_nothing(items: list[Any], swap: Any, failpoint: tuple[str, int] | None) -> None:
    """``swap(*item)`` for every item; when one fails, the ones done are swapped back (a swap
    is its own inverse)."""
    it: Iterable[Any] = items if failpoint is None else _failpoints.fail_after(items, failpoint)
    done = 0
    try:
        with torch.no_grad():
            for item in it:
                swap(*item)
                done += 1
    except BaseException:
        with torch.no_grad():
            for item in items[:done]:
                swap(*item)
        raise


def _swap_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    tmp = a.detach().clone()
    a.detach().copy_(b.detach())
    b.detach().copy_(tmp)


def _tensor_pairs(lv: Any, sv: Any, where: str, depth: int) -> Iterable[tuple[Any, Any]]:
    """The (live, shadow) tensor pairs inside two values of one attribute (see
    :meth:`Prepared.plan_in_place`); raises ``ValueError`` naming ``where`` when they cannot
    be exchanged in place."""
    if lv is sv:
        return
    if isinstance(lv, torch.Tensor) and isinstance(sv, torch.Tensor):
        got = [(tuple(t.shape), t.dtype, t.device) for t in (lv, sv)]
        if got[0] != got[1] or lv.device.type == "meta":
            raise ValueError(
                f"mx: {where} cannot be exchanged in place: live {got[0]}, prepared {got[1]}"
            )
        if lv.numel() and lv.untyped_storage().data_ptr() == sv.untyped_storage().data_ptr():
            raise ValueError(f"mx: {where} cannot be exchanged in place: both share one storage")
        yield lv, sv
        return
    if isinstance(lv, dict) and isinstance(sv, dict):
        if lv.keys() != sv.keys():
            raise ValueError(
                f"mx: {where} cannot be exchanged in place: keys {sorted(map(str, lv))} live, "
                f"{sorted(map(str, sv))} prepared"
            )
        for k in lv:
            yield from _tensor_pairs(lv[k], sv[k], f"{where}[{k!r}]", depth)
        return
    if isinstance(lv, (list, tuple)) and type(lv) is type(sv) and len(lv) == len(sv):
        for i, (x, y) in enumerate(zip(lv, sv, strict=True)):
            yield from _tensor_pairs(x, y, f"{where}[{i}]", depth)
        return
    # A quant method copied for the shadow: its state, one level down.
    plain = not isinstance(lv, torch.nn.Module) and not callable(lv) and hasattr(lv, "__dict__")
    if type(lv) is type(sv) and plain and depth < 2:
        yield from _tensor_pairs(vars(lv), vars(sv), where, depth + 1)
        return
    try:
        equal = bool(lv == sv)
    except Exception:
        equal = False
    if not equal:
        raise ValueError(
            f"mx: {where} cannot be exchanged in place: vLLM's processing set a new "
            f"{type(sv).__name__} there (not a tensor of the live one's shape); only an "
            "exchange of objects installs it"
        )


def _swap(_name: str, live: Any, shadow: Any, keys: frozenset[str]) -> None:
    ld, sd = live.__dict__, shadow.__dict__
    for k in keys:
        lv, sv = ld.pop(k, _ABSENT), sd.pop(k, _ABSENT)
        if sv is not _ABSENT:
            ld[k] = sv
        if lv is not _ABSENT:
            sd[k] = lv


_ABSENT = object()


def forget_cpu_moe_kernel(method: Any) -> bool:
    """Clears ``method.moe_kernel`` when ``method`` is vLLM's unquantized CPU experts method
    with a kernel built (True), so that processing takes the first-load path: vLLM pads each
    expert's intermediate size to a multiple of 32 and prepacks w13 and w2 only on a first load
    (``UnquantizedFusedMoEMethod._setup_kernel``); on a weight update it skips both, and the
    experts would compute with unpacked weights in packed storage. GPU backends are left alone.
    """
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
            UnquantizedMoeBackend,
        )
    except ImportError:  # a vLLM without this backend oracle
        return False
    if (
        getattr(method, "unquantized_backend", None) == UnquantizedMoeBackend.CPU
        and getattr(method, "moe_kernel", None) is not None
    ):
        method.moe_kernel = None
        return True
    return False


def live_state(model: torch.nn.Module) -> list[Any]:
    """The objects that hold ``model``'s processed weights (every module's parameters, buffers,
    quant method and packed GEMM closure ``cpu_linear``): compared by identity with
    :func:`same_state`, it tells whether anything replaced them since (vLLM's own
    ``reload_weights``, another weight-transfer path), which an exchange cannot see. The list
    holds them, so an identity cannot be reused while it is kept."""
    out: list[Any] = []
    for m in model.modules():
        d = m.__dict__
        out.extend(d["_parameters"].values())
        out.extend(d["_buffers"].values())
        out.append(d.get("quant_method"))
        out.append(d.get("cpu_linear"))
    return out


def same_state(a: list[Any] | None, b: list[Any]) -> bool:
    """Whether two :func:`live_state` lists hold the very same objects."""
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class _Shadows:
    """Builds the shadow tree (one shadow per module, memoized: a module reached twice is one
    shadow, a parameter shared by two modules one tensor). A shadow tensor that vLLM recorded
    reload metadata for starts as a placeholder on the meta device whose weight loader
    allocates it on first use (:meth:`materialize`): the real tensor replaces the placeholder
    in every module holding it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.modules: dict[int, torch.nn.Module] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        # id(placeholder) -> (placeholder, its loader, module name, [(holder dict, key)]).
        self.pending: dict[int, tuple[torch.Tensor, Any, str, list[tuple[dict, str]]]] = {}
        # id(placeholder) -> (placeholder, the real tensor, weakly): a loader may be handed
        # the placeholder again (vLLM's ``load_weights`` looks its parameters up once per
        # call); the placeholder is kept so that its id is not reused.
        self.real: dict[int, tuple[torch.Tensor, weakref.ref]] = {}

    def of(
        self, m: torch.nn.Module, before: dict[int, dict[str, Any]], name: str = ""
    ) -> torch.nn.Module:
        if id(m) in self.modules:
            return self.modules[id(m)]
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        s = m.__class__.__new__(m.__class__)
        # What the live module held when its shadow was made: the exchange swaps every
        # attribute in which the shadow differs from it (see Prepared.build).
        before[id(s)] = dict(m.__dict__)
        d = dict(m.__dict__)
        d["_parameters"], d["_buffers"], d["_modules"] = {}, {}, {}
        d["_non_persistent_buffers_set"] = set(m._non_persistent_buffers_set)
        method = d.get("quant_method")
        if method is not None:
            d["quant_method"] = copy.copy(method)
            # The shadow's experts are a first load: padded and prepacked afresh.
            forget_cpu_moe_kernel(d["quant_method"])
        object.__setattr__(s, "__dict__", d)
        # A quant method that is a module itself (vLLM's fused-MoE methods are, and sit in
        # their layer's ``_modules``): its shadow's experts are a first load too.
        forget_cpu_moe_kernel(s)
        self.modules[id(m)] = s
        for key, child in m._modules.items():
            sub = f"{name}.{key}" if name else key
            d["_modules"][key] = None if child is None else self.of(child, before, sub)
        meta_params, meta_buffers = get_layerwise_info(m).restore_metadata
        # Entries registered as None (a linear layer without bias) stay None.
        for key, p in m._parameters.items():
            meta = meta_params.get(key)
            d["_parameters"][key] = None if p is None else self._tensor(p, meta, m, s, name)
            self._held(d["_parameters"], key)
        # A non-persistent buffer is no checkpoint tensor (RoPE's cos/sin cache): no loader
        # writes it, so it keeps its values (vLLM's reload keeps the live one too).
        for key, b in m._buffers.items():
            kept = key in m._non_persistent_buffers_set
            meta = None if kept else meta_buffers.get(key)
            d["_buffers"][key] = None if b is None else self._tensor(b, meta, m, s, name)
            self._held(d["_buffers"], key)
        return s

    def _held(self, holder: dict[str, Any], key: str) -> None:
        """Notes that ``holder[key]`` holds a placeholder (replaced when it is materialized)."""
        t = holder[key]
        if t is not None and id(t) in self.pending:
            self.pending[id(t)][3].append((holder, key))

    def materialize(self, placeholder: torch.Tensor) -> torch.Tensor:
        """The real tensor for ``placeholder`` (allocated on the shadows' device now, unless it
        was before), in place of the placeholder in every module that holds it."""
        if id(placeholder) in self.real:
            real = self.real[id(placeholder)][1]()
            if real is None:
                raise RuntimeError(
                    "mx: a weight loader wrote a shadow tensor after its layer was processed"
                )
            return real
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

        _, loader, _, holders = self.pending.pop(id(placeholder))
        with self.device:
            real = materialize_meta_tensor(placeholder)
        # The loader it had (the placeholder's dictionary, copied, holds the materializing one).
        if loader is None:
            real.__dict__.pop("weight_loader", None)
        else:
            real.weight_loader = loader
        for holder, key in holders:
            holder[key] = real
        self.real[id(placeholder)] = (placeholder, weakref.ref(real))
        return real

    def materialize_under(self, prefixes: set[str]) -> None:
        """Materializes every placeholder of a module under one of ``prefixes`` (``{""}``:
        all of them, and the placeholders are forgotten): tensors no loader wrote, before
        their module is processed."""
        for key, (placeholder, _, name, _) in list(self.pending.items()):
            if key in self.pending and any((name + ".").startswith(p) for p in prefixes):
                self.materialize(placeholder)
        if "" in prefixes:
            self.real.clear()

    def _tensor(
        self, live: torch.Tensor, meta: torch.Tensor | None, m, s, name: str
    ) -> torch.Tensor:
        """The shadow of one live tensor: shared when its live tensor is shared; a placeholder
        from vLLM's recorded metadata (the shape before processing) when there is some, else a
        copy of the live values (tensors no loader writes, such as RoPE caches and biases)."""
        if id(live) in self.tensors:
            return self.tensors[id(live)]
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

        if meta is not None:
            with torch.device("meta"):
                t = materialize_meta_tensor(meta)
        else:
            t = live.detach().clone()
            if isinstance(live, torch.nn.Parameter):
                t = torch.nn.Parameter(t, requires_grad=False)
            t.__dict__ = dict(live.__dict__)
        # The tensor's weight loaders (``weight_loader``, or ``_weight_loader`` of vLLM's
        # parameter classes) must load into the shadow: vLLM's reload leaves its deferring
        # wrapper (``online_process_loader``, which would process the *live* layer) on the
        # recorded metadata after the first reload, and rebinds the layer's methods from a
        # sentinel to the live layer; unwrap, and bind them to the shadow.
        for key, value in list(t.__dict__.items()):
            while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
                value = value.__wrapped__
            if isinstance(value, MethodType) and value.__self__ in (layer_ref_sentinel, m):
                value = value.__func__.__get__(s)
            t.__dict__[key] = value
        if meta is not None:
            loader = _loader_of(t)
            self.pending[id(t)] = (t, loader, name, [])
            t.weight_loader = self._materializing(loader)
        self.tensors[id(live)] = t
        return t

    def _materializing(self, loader: Any) -> Any:
        """``loader`` (``None``: vLLM's ``default_weight_loader``) called with the real tensor
        in place of a placeholder."""
        if loader is None:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            loader = default_weight_loader

        def materializing_loader(param: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if id(param) in self.pending or id(param) in self.real:
                param = self.materialize(param)
            return loader(param, *args, **kwargs)

        return materializing_loader


def _loader_of(t: torch.Tensor) -> Any:
    """``t``'s weight loader, ``None`` when it has none (vLLM then uses its
    ``default_weight_loader``)."""
    try:
        return getattr(t, "weight_loader", None)
    except (AttributeError, ValueError):  # vLLM's parameter classes, their loader deleted
        return None
