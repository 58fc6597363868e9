"""The engine side of mx's vLLM weight-transfer backend (``"backend": "mx"``).

One :class:`MxWeightTransferEngine` lives in every vLLM worker process (one per
tensor-parallel rank). At ``init_transfer_engine`` it:

1. derives the rank's destination layout from the vLLM model (a placeholder pass through its
   weight loaders, :mod:`mx.vllm._layout`) and compares it with mx-layout's vLLM rules
   (``tp:N``: fused ``qkv_proj``/``gate_up_proj``, column/row splits); any disagreement fails
   init naming the parameter;
2. allocates the rank's parameters in vLLM's layout on the host (``rank_bytes``: the bytes of
   this rank only), fills them with the checkpoint vLLM loaded at start-up (resident as
   ``disk:<model dir>``), and registers them with an :class:`mx.Puller`;
3. follows the control plane as worker ``<instance_id>-tp<rank>`` of instance
   ``instance_id`` whose engine routes are vLLM's own at ``engine_url``: the control plane
   stages versions into the puller over its command stream (pull + verify, while vLLM keeps
   generating).

Once a version is staged, and before the control plane hears so (so before anything pauses),
the backend *prepares* it (``prepare``, on by default with ``install="reload"``): it reads the
staged rank out of the puller and runs vLLM's own loaders and post-load processing on a second,
*shadow* set of the model's layers (:class:`mx.vllm._prepared.Prepared`) while vLLM keeps
generating on the live set.

A refit's APPLY calls the server's ``/start_weight_update``, ``/update_weights`` with
``{"update_info": {"version_id": V}}`` and ``/finish_weight_update``; ``update_weights``
installs V at that safe point: the puller copies it from staging into the host parameters
(retaining the previous version: the rollback source), then vLLM takes it in one of three ways:

- *exchange* (V was prepared): the live layers and their shadows swap their processed state
  (parameters, buffers, the packed GEMM handles, the quant method), module by module; no
  loader runs in the pause. The exchanged-out set holds the version served before: a rollback
  to it is the same exchange back. It stays until the next version is staged.
- ``install="reload"`` (the default on CPU, where vLLM repacks Linear weights after loading and
  the parameters it created are empty): vLLM's layerwise reload, fed checkpoint-format tensors
  that are full-shaped but hold only this rank's slices (vLLM's loaders read nothing else), in
  decoder-layer order. Cost per install: one pass of vLLM's loaders and its repacking over the
  rank's bytes, plus one transient full-shaped tensor per checkpoint tensor of one layer.
- ``install="inplace"`` (the default on GPU, where parameters keep their memory): a copy of the
  rank's bytes into the parameters in place, nothing else; or, with ``prepare=True``, an
  exchange of bytes: each live tensor swaps its values with its prepared shadow's (device to
  device) and keeps its address, as captured CUDA graphs need. A processed form that is not
  tensors of the live shapes (vLLM's packed CPU GEMM handles) cannot be exchanged so: the
  prepare says which attribute and the install copies from the host instead.

Resident memory beside vLLM's own weights: the rank's bytes (host parameters) + staging (at
most 1x, kept for the next stage) + the retained previous version (``retain``): without
``prepare`` a copy of its own (1x); with it, kept in staging (the puller's ``retain="in_staging"``:
an apply exchanges the staged and the host bytes, so staging then holds the version served
before) beside one processed set of the rank's weights (the prepared version, then the rollback
source), so the count of rank-sized buffers beside vLLM's is three either way; while a version is
being prepared, one window of staging's bytes more (a decoder layer's, or the embeddings'). The
worker method ``mx_memory`` reports each of these, vLLM's own weights and the process's resident
set now and at its peak (:meth:`memory`).

A failed install puts the previous version back before the error is returned (the puller
restores its retained copy and vLLM reloads it), so vLLM never serves a half-installed version;
the control plane then rolls the refit back. An update refused before the install begins (an
``update_info`` without ``version_id``, a malformed id, an mx id never staged) changes nothing:
vLLM's layerwise reload starts only once the version is in the host parameters, not at
``start_weight_update``. A rollback (``update_weights`` naming the retained version) installs
the retained host copy: no pull.

Failpoints for tests: with ``MX_VLLM_FAILPOINT_FILE=PATH`` in the server's environment, an
install finding ``install_after:N`` in that file deletes it and raises after N checkpoint
tensors were loaded (so at least one decoder layer was reloaded, with N >= 10 on llama), or
an exchange after N of its module pairs were swapped (they are swapped back);
``die_after:N`` SIGKILLs the server's process group there instead (a crash during APPLY; run
the server in a session of its own).
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from .. import _failpoints
from .._http import url_problem
from .._memory import _error
from .._model import Model
from .._puller import Puller
from ..fp8 import Fp8Param, fp8_layout, quantize_params
from . import _fp8, _layout
from ._prepared import Prepared, forget_cpu_moe_kernel, live_state, same_state

logger = init_logger("vllm.mx")

INSTALL_MODES = ("auto", "reload", "inplace")
ENGINE_APIS = ("vllm", "dynamo")


def _need(cond: bool, field: str, what: str) -> None:
    if not cond:
        raise ValueError(f"mx init_info.{field}: {what}")


@dataclass
class MxInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``POST /init_weight_transfer_engine`` for the mx backend.

    Attributes:
        control_url: the mx control plane, ``http://host:port``.
        instance_id: this vLLM server's instance name in the fleet; its workers register as
            ``<instance_id>-tp<rank>``.
        engine_url: this vLLM server's base URL as the control plane reaches it
            (``http://host:port``): where refits call the native RL routes.
        retain: keep the previous version (1x the rank's bytes) so a rollback needs no
            source: a host copy of its own, or with ``prepare`` kept in staging (the puller's
            ``retain="in_staging"``: installs exchange staging and the host copy).
        install: ``"reload"`` (vLLM's layerwise reload), ``"inplace"`` (copy into the
            parameters) or ``"auto"`` (in place on GPU, reload otherwise).
        fill_nan: fill the parts of the reload tensors that belong to other ranks with NaN
            instead of leaving them uninitialized (a check that vLLM reads only this rank's
            slices; costs a memset per tensor).
        check_layout: run the placeholder pass and compare with mx's layout (default on).
        engine_api: the routes the control plane calls at ``engine_url``: ``"vllm"`` (vLLM's
            own RL routes, the default) or ``"dynamo"`` (a Dynamo worker's system routes:
            ``engine_url`` is its ``system_url``, and installs come through
            ``update_weights_from_distributed`` with ``engine_rpc: "mx_install"``).
        frontend_url: a Dynamo worker's frontend (``http://host:port``), where the control plane
            runs its post-update generation (``/v1/completions`` pinned to the worker); required
            with ``engine_api="dynamo"``.
        served_model: the model name the frontend serves (``--served-model-name``); required
            with ``engine_api="dynamo"``.
        backend_instance_id: the worker's ``instance_id`` as ``GET /v1/rl/workers`` lists it (a
            u64); required with ``engine_api="dynamo"``.
        prepare: build vLLM's processed form of every staged version while vLLM generates,
            so the install is an exchange: of the processed objects with ``install="reload"``,
            of the bytes of every processed tensor with ``install="inplace"`` (each live tensor
            keeps its address, as CUDA graphs need: three device copies of the rank's bytes in
            the pause instead of a host-to-device copy). One processed copy of the rank's
            weights more, on vLLM's device (in place of the retained host copy's own buffer).
            ``None`` (the default): on with ``install="reload"``, off with ``"inplace"`` (GPU
            memory is the KV cache's). Ignored by FP8.
    """

    control_url: str
    instance_id: str
    engine_url: str
    retain: bool = True
    install: str = "auto"
    fill_nan: bool = False
    check_layout: bool = True
    engine_api: str = "vllm"
    frontend_url: str = ""
    served_model: str = ""
    backend_instance_id: int = 0
    prepare: bool | None = None

    def __post_init__(self) -> None:
        for f in ("control_url", "instance_id", "engine_url"):
            v = getattr(self, f)
            _need(isinstance(v, str) and v != "", f, f"must be a non-empty string, got {v!r}")
        for f in ("control_url", "engine_url"):
            bad = url_problem(getattr(self, f))
            _need(bad is None, f, str(bad))
        for f in ("retain", "fill_nan", "check_layout"):
            v = getattr(self, f)
            _need(isinstance(v, bool), f, f"must be true or false, got {v!r}")
        v = self.prepare
        _need(v is None or isinstance(v, bool), "prepare", f"must be true, false or null: {v!r}")
        _need(self.install in INSTALL_MODES, "install", f"must be one of {INSTALL_MODES}")
        _need(self.engine_api in ENGINE_APIS, "engine_api", f"must be one of {ENGINE_APIS}")
        if self.engine_api == "dynamo":
            bad = url_problem(self.frontend_url)
            _need(bad is None, "frontend_url", f"the Dynamo frontend's URL: {bad}")
            v = self.served_model
            _need(isinstance(v, str) and v != "", "served_model", f"must be named, got {v!r}")
            v = self.backend_instance_id
            _need(
                isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**64,
                "backend_instance_id",
                f"must be the worker's instance_id (a u64), got {v!r}",
            )

    def frontend(self) -> tuple[str, str, int] | None:
        """``(frontend_url, served_model, backend_instance_id)`` of a Dynamo worker, else
        ``None``."""
        if self.engine_api != "dynamo":
            return None
        return (self.frontend_url, self.served_model, self.backend_instance_id)


@dataclass
class MxUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``POST /update_weights`` for the mx backend.

    Attributes:
        version_id: the version to install: an mx version id ``mx:<64 hex>`` staged on every
            rank (or resident already), or the retained previous version's id (a rollback,
            e.g. ``disk:<model dir>`` for the weights vLLM started with).
    """

    version_id: str

    def __post_init__(self) -> None:
        v = self.version_id
        if not isinstance(v, str) or not v:
            raise ValueError(f"mx update_info.version_id: must be a non-empty string, got {v!r}")


class MxWeightTransferEngine(WeightTransferEngine[MxInitInfo, MxUpdateInfo]):
    """mx's weight-transfer engine for one vLLM worker (see the module docs)."""

    init_info_cls = MxInitInfo
    update_info_cls = MxUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._puller: Puller | None = None
        self._rank = 0
        self._infos: list = []
        self._params: dict[str, torch.Tensor] = {}
        self._view: _layout.CheckpointView | None = None
        self._served: list = []
        self._checkpoint: list = []
        self._fp8: list[Fp8Param] | None = None
        self._mode = "reload"
        self._fill_nan = False
        self._reloading = False
        self._prepare = False
        self._retain = False
        # The other processed set: (the version it holds, its shadows). Prepared for a staged
        # version; after an exchange, the version exchanged out (the rollback source).
        self._other: tuple[str | None, Prepared] | None = None
        # One prepare or exchange at a time (the puller's thread prepares; vLLM's installs).
        self._other_lock = threading.Lock()
        # vLLM's live weight objects after the last install mx made (or vLLM's own load at
        # start-up): when they differ, something else changed vLLM's weights behind mx's back.
        self._live_mark: list[Any] | None = None
        # The resident-set bytes the first prepared set added (one processed set).
        self._other_rss: int | None = None
        self.last_install: dict[str, Any] = {}
        self.last_prepare: dict[str, Any] = {}
        # The init this engine follows the control plane with (None before and after shutdown).
        self._init_info: MxInitInfo | None = None
        # After shutdown: (the version the host parameters and vLLM still hold, the control
        # plane that named it), so an init that follows that control plane again declares it
        # resident rather than the checkpoint on disk.
        self._detached: tuple[str | None, str] | None = None

    # --- init ------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: MxInitInfo) -> None:
        """Follows the control plane as ``<instance_id>-tp<rank>`` (see the module docs).

        The same init again (a trainer that restarted) changes nothing and succeeds. Another
        init while following is refused, naming the fields that differ: POST
        ``/shutdown_weight_transfer_engine`` first. After a shutdown, an init that follows the
        same control plane declares resident the version vLLM still serves (not the checkpoint
        on disk); one that follows another control plane declares none (that version's id means
        nothing to the other journal, which would halt on it): the worker is admitted there
        after its first refit. The retained previous version was dropped by the shutdown.

        Raises:
            RuntimeError: initialized already with another init info.
            ValueError: a parallelism mx does not serve, a layout disagreement (named).
            MxError: the control plane or NIXL failed.
        """
        if self._puller is not None and self._init_info is not None:
            self._same_init(init_info)
            return
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pc = self.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ValueError(
                f"mx: pipeline parallelism ({pc.pipeline_parallel_size} stages) is not supported"
            )
        if pc.data_parallel_size != 1:
            raise ValueError(
                f"mx: data parallelism ({pc.data_parallel_size} replicas in one server) is not "
                "supported: run one server per replica"
            )
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        # With --enable-expert-parallel the routed experts are whole and spread over the ranks
        # (vLLM's linear placement); everything else is split as under tp.
        layout = f"tp-ep:{tp}" if getattr(pc, "enable_expert_parallel", False) else f"tp:{tp}"
        model_dir = str(self.model_config.model)
        if not os.path.isdir(model_dir):
            raise ValueError(f"mx: vLLM's model {model_dir!r} is not a local checkpoint directory")
        t0 = time.perf_counter()
        fp8 = _fp8.is_block_fp8(self.vllm_config)
        if fp8:
            checkpoint = _fp8.checkpoint_tensors(model_dir)
            mx_model = _fp8.source_model(model_dir, checkpoint)
        else:
            mx_model = Model.from_dir(model_dir)
            checkpoint = [(t.name, t.dtype, tuple(t.shape)) for t in mx_model.tensors]
        mode = init_info.install
        if mode == "auto":
            mode = "inplace" if self.device.type == "cuda" else "reload"
        prepare = init_info.prepare
        if prepare is None:
            prepare = mode == "reload"
        prepare = prepare and not fp8
        # With a prepared set, the retained raw copy lives in staging (an apply exchanges them):
        # the processed set is the one held beside vLLM's instead.
        retain: bool | str = init_info.retain
        if retain and prepare:
            retain = "in_staging"
        puller = Puller(
            init_info.control_url,
            model=mx_model,
            layout=layout,
            ranks=[rank],
            retain=retain,
        )
        try:
            infos = puller.params(rank)
            # The parameters as the server holds them: FP8 ones in e4m3 plus their scales.
            # Its FP8 parameters (a slice that cuts a block is refused here, naming it).
            quantized = fp8_layout(mx_model, layout, rank) if fp8 else None
            served = _fp8.engine_infos(infos, quantized) if quantized is not None else infos
            t1 = time.perf_counter()
            if init_info.check_layout:
                self._check_layout(rank, served, checkpoint)
            t2 = time.perf_counter()
            if mode == "inplace":
                self._check_in_place(served)
            detached = self._detached
            if detached is not None:
                # Following again after a shutdown: the host parameters hold what vLLM serves,
                # a version only the control plane that named it knows.
                params = self._params
                resident = detached[0] if detached[1] == init_info.control_url else None
                if resident is None and detached[0] is not None:
                    logger.warning(
                        "mx: rank %d follows another control plane (%s, was %s): %s, served "
                        "now, is not a version it knows: registered with no resident version "
                        "until its first refit",
                        rank,
                        init_info.control_url,
                        detached[1],
                        detached[0],
                    )
            else:
                params = {
                    p.name: torch.empty(p.shape, dtype=_layout.torch_dtype(p.dtype)) for p in infos
                }
                # The server's start-up weights, resident until the first refit (an FP8
                # server's are e4m3 only: no bf16 version to serve or roll back to).
                resident = None if fp8 else f"disk:{model_dir}"
                if not fp8:
                    _layout.read_rank(model_dir, infos, params)
            puller.register(rank, params)
            if resident is not None:
                puller.set_resident(resident)
            worker_id = f"{init_info.instance_id}-tp{rank}"
            limits = (self.model_config.get_vocab_size(), self.model_config.max_model_len)
            self._prepare = prepare
            # What the prepare hook reads, set before the control plane can stage anything.
            self._puller, self._rank, self._infos = puller, rank, infos
            self._checkpoint = checkpoint
            puller.follow(
                worker_id,
                instance=init_info.instance_id,
                engine_url=init_info.engine_url,
                engine_api=init_info.engine_api,
                limits=limits,
                frontend=init_info.frontend(),
                on_staged=self._on_staged if self._prepare else None,
            )
        except BaseException:
            self._puller = None
            puller.close()
            raise
        self._puller, self._rank, self._infos, self._params = puller, rank, infos, params
        self._served, self._checkpoint = served, checkpoint
        # Looked up once here rather than inside every install.
        self._fp8 = quantized
        self._view = _layout.CheckpointView(infos, params, checkpoint)
        self._mode, self._fill_nan = mode, init_info.fill_nan
        self._retain = init_info.retain
        self._init_info, self._detached = init_info, None
        self._live_mark = live_state(self.model) if self._prepare else None
        logger.info(
            "mx: rank %d of %s follows %s as %s (install %s%s; %d parameters, %d bytes; "
            "layout checked in %.2f s, set up in %.2f s)",
            rank,
            layout,
            init_info.control_url,
            worker_id,
            mode,
            ", prepared while generating" if self._prepare else "",
            len(infos),
            sum(p.nbytes for p in infos),
            t2 - t1,
            time.perf_counter() - t0,
        )

    def _same_init(self, init_info: MxInitInfo) -> None:
        """Accepts ``init_info`` equal to the one followed; else raises RuntimeError naming the
        fields that differ."""
        from dataclasses import fields

        held = self._init_info
        assert held is not None and self._puller is not None
        differ = [
            f.name
            for f in fields(MxInitInfo)
            if getattr(init_info, f.name) != getattr(held, f.name)
        ]
        resident = self._puller.versions.resident
        if not differ:
            logger.info(
                "mx: rank %d: the same init again (a trainer re-attaching): still following %s "
                "as %s-tp%d, serving %s",
                self._rank,
                held.control_url,
                held.instance_id,
                self._rank,
                resident,
            )
            return
        listed = ", ".join(f"{n} {getattr(held, n)!r} -> {getattr(init_info, n)!r}" for n in differ)
        raise RuntimeError(
            f"mx: rank {self._rank} already follows {held.control_url} as instance "
            f"{held.instance_id!r} (serving {resident}); this init differs in {listed}: POST "
            "/shutdown_weight_transfer_engine first (the server keeps serving its version and "
            "drops the retained previous one), or send the same init_info"
        )

    def _check_layout(self, rank: int, infos, checkpoint) -> None:
        bad = _layout.check(self.vllm_config, rank, infos, checkpoint)
        if bad:
            listed = "; ".join(f"{d.param}: {d.reason}" for d in bad[:5])
            raise ValueError(
                f"mx: vLLM's rank {rank} and mx's layout disagree on {len(bad)} parameter(s): "
                f"{listed}"
            )

    def _check_in_place(self, infos) -> None:
        named = dict(self.model.named_parameters())
        for p in infos:
            t = named.get(p.name)
            want = (tuple(p.shape), _layout.torch_dtype(p.dtype))
            if t is None or (tuple(t.shape), t.dtype) != want or t.data_ptr() == 0:
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise ValueError(
                    f"mx: install='inplace' needs vLLM's parameter {p.name} as {want}, it is "
                    f"{got} (vLLM repacked or dropped it: use install='reload')"
                )

    def _need_init(self) -> Puller:
        if self._puller is None:
            raise RuntimeError(
                "mx: the weight-transfer engine is not initialized: call "
                "/init_weight_transfer_engine (init_info with control_url, instance_id, "
                "engine_url) first"
            )
        return self._puller

    # --- one update session ---------------------------------------------------------------
    def start_weight_update(self) -> None:
        # vLLM's layerwise reload (which moves the model's weights to the meta device until
        # the reload is finalized) begins only once an install can proceed (receive_weights):
        # an update refused before that leaves vLLM serving what it served.
        self._need_init()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes torch.accelerator, which raises on a CUDA build of torch
        # without a GPU (the CPU machines): synchronize only a CUDA device.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: MxUpdateInfo) -> None:
        puller = self._need_init()
        version = update_info.version_id
        before = puller.versions
        t0 = time.perf_counter()
        # Refused here (an id never staged, not resident nor retained, not an mx id): nothing
        # changed, neither the host parameters nor vLLM.
        kind = self._to_host(version)
        t1 = time.perf_counter()
        untouched = not self._prepare or same_state(self._live_mark, live_state(self.model))
        if kind == "already_resident" and untouched:
            # vLLM serves it: every install and every failed one leaves vLLM serving the
            # resident version (a failure that could not, says restart), and nothing else
            # replaced vLLM's weights since.
            how = "none"
        elif self._exchange(version, before.resident, untouched):
            how = "exchange"
        else:
            how = self._mode
            self._reload_or_copy(version, before.resident)
        if self._prepare:
            self._live_mark = live_state(self.model)
        t2 = time.perf_counter()
        self.last_install = {
            "version_id": version,
            "kind": kind,
            "mode": how,
            "host_s": t1 - t0,
            "vllm_s": t2 - t1,
        }
        logger.info(
            "mx: rank %d installed %s (%s; host copy %.3f s, into vLLM by %s %.3f s)",
            self._rank,
            version,
            kind,
            t1 - t0,
            how,
            t2 - t1,
        )

    def _exchange(self, version: str, previous: str | None, untouched: bool) -> bool:
        """Swaps in the set prepared for ``version`` when there is one (True), else False.
        The exchanged-out set then holds ``previous`` (what vLLM served), unless something else
        replaced vLLM's weights since mx's last install (not ``untouched``): then it is dropped.
        A failed exchange swaps back what it swapped and puts ``previous`` back in the host
        parameters."""
        with self._other_lock:
            other = self._other
            if other is None or other[0] != version:
                return False
            try:
                armed = _failpoints.take("MX_VLLM_FAILPOINT_FILE")
                other[1].exchange(failpoint=armed, in_place=self._mode == "inplace")
            except BaseException as e:
                logger.error(
                    "mx: exchanging in %s failed (%s); vLLM serves %s", version, e, previous
                )
                self._host_back(previous, version, e)
                raise
            if not untouched:
                logger.warning(
                    "mx: vLLM's weights were replaced outside mx since its last install; "
                    "the set exchanged out is dropped (a rollback reloads the retained copy)"
                )
            self._other = (previous, other[1]) if untouched else None
        return True

    def _reload_or_copy(self, version: str, previous: str | None) -> None:
        """vLLM takes the host parameters by its layerwise reload (or a copy in place)."""
        try:
            if self._mode == "reload" and not self._reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                self._reloading = True
                _reset_cpu_moe_kernels(self.model)
                initialize_layerwise_reload(self.model)
            self._into_vllm(failpoint=True)
        except BaseException as e:
            self._restore(previous, version, e)
            raise

    def finish_weight_update(self) -> None:
        self._need_init()
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
            _refresh_tied_heads(self.model)

    # --- installing -----------------------------------------------------------------------
    def _to_host(self, version: str) -> str:
        """Makes ``version`` resident in the host parameters; returns how."""
        puller = self._need_init()
        v = puller.versions
        if version == v.resident:
            return "already_resident"
        if version == v.retained:
            return puller.rollback().kind
        if not _layout.is_mx_version(version):
            raise _error(
                f"mx: version {version!r} is not resident ({v.resident}), retained "
                f"({v.retained}) or an mx version id",
                "NotFound",
            )
        return puller.apply(version).kind

    def _into_vllm(self, failpoint: bool) -> None:
        params, view = self._params, self._view
        if self._fp8 is not None:
            # The host bf16 parameters quantized for the FP8 server, at every install.
            params = quantize_params(self._infos, self._fp8, self._params)
            view = _layout.CheckpointView(self._served, params, self._checkpoint)
        if self._mode == "inplace":
            named = dict(self.model.named_parameters())
            with torch.no_grad():
                for p in self._served:
                    named[p.name].data.copy_(params[p.name], non_blocking=True)
            return
        assert view is not None
        armed = _failpoints.take("MX_VLLM_FAILPOINT_FILE") if failpoint else None
        tensors = view.tensors(fill_nan=self._fill_nan)
        if armed is not None:
            tensors = _failpoints.fail_after(tensors, armed)
        with torch.no_grad():
            self.model.load_weights(tensors)

    def _host_back(self, previous: str | None, version: str, err: BaseException) -> None:
        """The host parameters back to ``previous`` (the retained copy) after ``version``
        failed to go into vLLM and vLLM still serves ``previous``."""
        try:
            self._host_rollback(previous)
        except BaseException as e2:
            logger.critical("mx: restoring %s in the host copy failed too: %s", previous, e2)
            raise RuntimeError(
                f"mx: installing {version} failed ({err}) and restoring {previous} in the host "
                f"copy failed ({e2}): restart this vLLM"
            ) from e2

    def _host_rollback(self, previous: str | None) -> None:
        """The retained copy back into the host parameters when it holds ``previous`` and the
        host parameters do not."""
        puller = self._need_init()
        v = puller.versions
        if previous is not None and v.resident != previous and v.retained == previous:
            puller.rollback()

    # --- preparing while vLLM generates ---------------------------------------------------
    def _on_staged(self, version: str) -> None:
        """The puller's hook for each version it staged (see the module docs): the version's
        processed form built on shadow layers; the live layers are not touched. Replaces the
        other set (a prepared version never installed, or the last rollback source)."""
        t0 = time.perf_counter()
        with self._other_lock:
            # Dropped first, and its memory handed back (the build may run on another thread,
            # whose glibc arena would not reuse it): the peak is one processed set beside vLLM's.
            if self._other is not None:
                self._other = None
                _release_freed_memory()
            # What the processed set takes as the process's resident set shows it (vLLM's CPU
            # kernels hold repacked weights outside torch's tensors): measured around the first
            # build, when nothing freed before it can be reused by it.
            measure = self._other_rss is None
            if measure:
                gc.collect()
                rss0 = self._rss()
            try:
                prepared, window = self._build(version)
                if self._mode == "inplace":
                    prepared.plan_in_place()
            except BaseException as e:
                logger.warning(
                    "mx: preparing %s failed (%s); it installs by %s", version, e, self._mode
                )
                raise
            self._other = (version, prepared)
            # The build's transients (the windows, the unpacked shadow weights vLLM repacked)
            # are freed by now, but glibc keeps most of them: per-thread arenas (this hook runs
            # on a puller thread) and, once large blocks were freed, a raised mmap threshold.
            # Handed back here, outside any pause.
            t_trim = time.perf_counter()
            trimmed = _release_freed_memory()
            trim_s = time.perf_counter() - t_trim
            if measure:
                self._other_rss = max(self._rss() - rss0, 0)
        self.last_prepare = {
            "trimmed": trimmed,
            "trim_s": trim_s,
            "version_id": version,
            "prepare_s": time.perf_counter() - t0,
            "window_bytes_peak": window,
        }
        logger.info(
            "mx: rank %d prepared %s while serving (%.3f s)",
            self._rank,
            version,
            self.last_prepare["prepare_s"],
        )

    def _build(self, version: str) -> tuple[Prepared, int]:
        """The shadows of the model loaded with the staged ``version`` of this rank, read from
        staging one window at a time (the tensors outside the decoder stack, then each layer:
        :func:`mx.vllm._layout.layer_windows`), each window dropped once vLLM's loaders copied
        it: the copy beside staging is one layer's bytes (or the embeddings'), not the rank's.
        Returns the shadows and the largest window's bytes."""
        puller = self._need_init()
        windows = _layout.layer_windows(self._infos, self._checkpoint)

        def tensors(runs, infos, checkpoint):
            params = _layout.read_runs(
                runs,
                infos,
                lambda buf, lo: puller.copy_staged(version, self._rank, buf, offset=lo),
            )
            return _layout.CheckpointView(infos, params, checkpoint).tensors()

        prepared = Prepared.build(
            self.model, self.model_config, self.device, (tensors(*w) for w in windows)
        )
        peak = max((sum(hi - lo for lo, hi in runs) for runs, _, _ in windows), default=0)
        return prepared, peak

    def memory(self) -> dict[str, Any]:
        """What this rank holds, by role, in bytes (the ``mx_memory`` worker method).

        ``vllm_weights``: vLLM's live weights: ``tensor_bytes`` (the storage of its parameters
        and buffers; repacked CPU parameters are empty) and ``rss_bytes``
        (one processed set as the resident set shows it: what the first prepared set added;
        ``None`` before one was built). ``mx``: the puller's roles (``registered_bytes``: the
        host copy of the resident version, what peers pull from, live digests read and a
        reload installs from; ``staging_bytes`` now and at its peak; ``retained_bytes``: a copy
        of the previous version's raw bytes, 0 when ``retained_in_staging``;
        ``retained_version``) and ``other_set``: the processed set beside vLLM's
        (``role`` ``prepared``: a staged version ready to exchange in; ``rollback source``: the
        version exchanged out; ``None`` without one), with the largest window of a prepare.
        ``process_rss_bytes`` and ``process_rss_bytes_peak``: this process (``VmRSS``,
        ``VmHWM``)."""
        puller = self._need_init()
        m = puller.memory_report()
        other = self._other
        held = puller.versions
        live = _storages(self.model)
        if other is None:
            other_set = None
        else:
            # A set for the staged version not yet installed is prepared; one exchanged out is
            # the rollback source (after a rollback, the set exchanged out is the staged
            # version's again: prepared).
            prepared = other[0] == held.staged and other[0] != held.resident
            other_set = {
                "version_id": other[0],
                "role": "prepared" if prepared else "rollback source",
                "tensor_bytes": sum(_storages(other[1].root, exclude=live).values()),
                "rss_bytes": self._other_rss,
            }
        return {
            "rank": self._rank,
            "process_rss_bytes": m.process_rss_bytes,
            "process_rss_bytes_peak": m.process_rss_bytes_peak,
            "vllm_weights": {
                "tensor_bytes": _weight_bytes(self.model),
                "rss_bytes": self._other_rss,
            },
            "mx": {
                "registered_bytes": sum(m.rank_bytes.values()),
                "staging_bytes": m.staging_bytes,
                "staging_bytes_peak": m.staging_bytes_peak,
                "retained_bytes": m.retained_bytes,
                "retained_version": held.retained,
                "retained_in_staging": self._prepare and self._retain,
                "other_set": other_set,
                "prepare_window_bytes_peak": self.last_prepare.get("window_bytes_peak"),
            },
        }

    def _rss(self) -> int:
        """This process's resident set size in bytes (``VmRSS``; 0 where not known)."""
        return self._need_init().memory_report().process_rss_bytes

    def _restore(self, previous: str | None, version: str, err: BaseException) -> None:
        """After a failed install of ``version``: the host parameters back to ``previous`` and
        vLLM reloaded from them, so nothing half-installed serves."""
        logger.error("mx: installing %s failed (%s); restoring %s", version, err, previous)
        try:
            if self._reloading:
                from vllm.model_executor.model_loader.reload import (
                    finalize_layerwise_reload,
                    initialize_layerwise_reload,
                )

                # Layers not reloaded get their kernel tensors back; reloaded ones hold
                # `version`: reload all of them from `previous`.
                finalize_layerwise_reload(self.model, self.model_config)
            self._host_rollback(previous)
            if self._reloading:
                _reset_cpu_moe_kernels(self.model)
                initialize_layerwise_reload(self.model)
                self._into_vllm(failpoint=False)
                finalize_layerwise_reload(self.model, self.model_config)
                _refresh_tied_heads(self.model)
            else:
                self._into_vllm(failpoint=False)
        except BaseException as e2:
            logger.critical("mx: restoring %s after a failed install failed too: %s", previous, e2)
            raise RuntimeError(
                f"mx: installing {version} failed ({err}) and restoring {previous} failed "
                f"({e2}): this vLLM's weights are undefined; restart it"
            ) from e2
        finally:
            self._reloading = False

    def engine_identity(self) -> dict[str, str] | None:
        """This rank's mx identity once initialized (``None`` before): what the control plane
        reads through vLLM's ``collective_rpc`` before it changes the engine (see
        :data:`mx.vllm.IDENTITY_METHOD`)."""
        return None if self._puller is None else self._puller.engine_identity()

    def shutdown(self) -> None:
        """Stops following the control plane (vLLM's ``/shutdown_weight_transfer_engine``;
        vLLM refuses it during a weight update). vLLM keeps serving the version it holds, and
        so do the host parameters: a later init follows again with that version resident. The
        retained previous version, staging and a prepared set are dropped. Idempotent."""
        puller = self._puller
        if puller is None:
            return
        resident = puller.versions.resident
        url = self._init_info.control_url if self._init_info is not None else ""
        self._puller, self._init_info = None, None
        puller.close()
        with self._other_lock:
            self._other = None
        self._detached = (resident, url)
        gc.collect()
        logger.info(
            "mx: rank %d stopped following the control plane; serving %s", self._rank, resident
        )


def _storages(module: torch.nn.Module, exclude: dict[int, int] | None = None) -> dict[int, int]:
    """``{data pointer: bytes}`` of every tensor storage ``module``'s tree holds (parameters,
    buffers, tensor attributes), each once, leaving out those in ``exclude``."""
    found: dict[int, int] = {}
    for m in module.modules():
        for v in m.__dict__.values():
            tensors = v.values() if isinstance(v, dict) else (v,)
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                    if ptr and (exclude is None or ptr not in exclude):
                        found[ptr] = st.nbytes()
    return found


def _release_freed_memory() -> bool:
    """Returns the heap memory this process freed to the system (glibc's ``malloc_trim(0)``,
    which also releases whole free pages inside every arena, after a ``gc.collect()``); False
    where the C library has no ``malloc_trim`` (not glibc)."""
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storage of ``model``'s parameters and buffers, each once (not the tensors
    vLLM binds to layers besides, such as the KV cache)."""
    found = {}
    for t in (*model.parameters(), *model.buffers()):
        st = t.untyped_storage()
        found[st.data_ptr()] = st.nbytes()
    found.pop(0, None)
    return sum(found.values())


def _reset_cpu_moe_kernels(model: Any) -> int:
    """Makes vLLM rebuild every CPU mixture-of-experts kernel when the reload processes its
    layer; returns how many it reset.

    vLLM's CPU experts pad each expert's intermediate size to a multiple of 32 and prepack w13
    and w2 into the kernel's own blocked format, but only on the first load: on a weight update
    (``UnquantizedFusedMoEMethod._setup_kernel`` with ``moe_kernel`` set) it skips both, and the
    layerwise reload then copies the freshly loaded, unpacked experts into the packed storage,
    so the experts compute with scrambled weights (or the copy fails where padding changed the
    shape). With ``moe_kernel`` cleared the reload takes the first-load path (pad, prepack,
    kernel rebuilt) before the processed tensors are copied back into the original storage.
    GPU backends are left alone: they copy the update into the kernel's tensors themselves.
    """
    return sum(forget_cpu_moe_kernel(getattr(m, "quant_method", None)) for m in model.modules())


def _refresh_tied_heads(model: Any) -> None:
    """Re-runs the weight processing of an ``lm_head`` tied to the input embedding.

    On CPUs with AVX512-BF16 (and on AMD Zen) vLLM's CPU backend prepacks each GEMM weight into a
    kernel handle when it processes weights after loading (``dispatch_cpu_unquantized_gemm``),
    the tied ``lm_head`` included. A layerwise reload reloads the embedding but skips the tied
    head, which has no checkpoint tensor of its own ("ParallelLMHead: Failed to load weights"),
    so the head would keep projecting with the packed copy of the old embedding. Its weight is
    the embedding's tensor, already holding the new version: processing it again repacks it.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is None or method is None or not hasattr(method, "process_weights_after_loading"):
        return
    method.process_weights_after_loading(head)
