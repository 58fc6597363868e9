"""mx.Publisher and mx.Puller over torch tensors the caller owns: a tiny llama (tp:3-placeable:
6 heads, 3 kv heads, vocab 192) published by two fsdp:2 slots from their own tensors and pulled
into an engine's own tp:3 tensors (vLLM's fused qkv/gate_up), byte for byte; and every bad
tensor refused with an error naming it."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

import mx

H, HEADS, KV, HEAD_DIM, FFN, VOCAB, LAYERS = 96, 6, 3, 16, 192, 192, 2
CONFIG = {
    "model_type": "llama",
    "hidden_size": H,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HEAD_DIM,
    "intermediate_size": FFN,
    "vocab_size": VOCAB,
    "num_hidden_layers": LAYERS,
    "tie_word_embeddings": False,
}


def _shapes() -> dict[str, tuple[int, ...]]:
    s = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,)}
    s["lm_head.weight"] = (VOCAB, H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        s[p + "self_attn.q_proj.weight"] = (HEADS * HEAD_DIM, H)
        s[p + "self_attn.k_proj.weight"] = (KV * HEAD_DIM, H)
        s[p + "self_attn.v_proj.weight"] = (KV * HEAD_DIM, H)
        s[p + "self_attn.o_proj.weight"] = (H, HEADS * HEAD_DIM)
        s[p + "mlp.gate_proj.weight"] = (FFN, H)
        s[p + "mlp.up_proj.weight"] = (FFN, H)
        s[p + "mlp.down_proj.weight"] = (H, FFN)
    return s


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    """BF16 weights with F32 norms (mixed dtypes, as some checkpoints keep them)."""
    g = torch.Generator().manual_seed(7)
    return {
        n: torch.randn(s, generator=g).to(torch.float32 if "norm" in n else torch.bfloat16)
        for n, s in _shapes().items()
    }


@pytest.fixture
def model(weights) -> mx.Model:
    return mx.Model.from_config(CONFIG, weights)


def _box(offset, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + e) for o, e in zip(offset, shape, strict=True))


def _rows(t: torch.Tensor, slot: int) -> tuple[int, int]:
    return t.shape[0] * slot // 2, t.shape[0] * (slot + 1) // 2


class Trainer:
    """Two fsdp:2 slots, each holding its dim-0 rows of every tensor as its own tensors."""

    def __init__(self, url: str, model: mx.Model, weights: dict[str, torch.Tensor]) -> None:
        self.shards = []
        self.pubs = []
        for slot in range(2):
            own = {}
            for name, t in weights.items():
                lo, hi = _rows(t, slot)
                own[name] = t[lo:hi].clone()
            pub = mx.Publisher(url, model=model, layout="fsdp:2", slot=slot)
            pub.set_shards(
                {n: (own[n], [_rows(t, slot)[0]] + [0] * (t.dim() - 1)) for n, t in weights.items()}
            )
            self.shards.append(own)
            self.pubs.append(pub)

    def publish(self, label: str, *, copy: bool = False) -> str:
        ids: list[str | BaseException | None] = [None, None]

        def run(i: int) -> None:
            try:
                ids[i] = self.pubs[i].publish(label, copy=copy, timeout=60)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                ids[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        for r in ids:
            if isinstance(r, BaseException):
                raise r
        assert ids[0] == ids[1] and isinstance(ids[0], str) and ids[0].startswith("mx:")
        return ids[0]

    def full(self) -> dict[str, torch.Tensor]:
        return {n: torch.cat([self.shards[0][n], self.shards[1][n]]) for n in self.shards[0]}

    def step(self, scale: float) -> None:
        """An in-place update of every shard (what an optimizer step does to the memory)."""
        with torch.no_grad():
            for own in self.shards:
                for t in own.values():
                    t.mul_(scale).add_(0.125)

    def close(self) -> None:
        for p in self.pubs:
            p.close()


class Engine:
    """An engine's own tp:3 tensors (all three ranks in one process), registered in place."""

    def __init__(self, url: str, model: mx.Model, ranks=(0, 1, 2), **kw) -> None:
        self.puller = mx.Puller(url, model=model, layout="tp:3", ranks=list(ranks), **kw)
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        for p in self.puller.params():
            dtype = torch.float32 if p.dtype == "F32" else torch.bfloat16
            t = torch.full(p.shape, float("nan"), dtype=dtype)
            self.params.setdefault(p.rank, {})[p.name] = t
        for rank, params in self.params.items():
            self.puller.register(rank, params)
        self.ptrs = {(r, n): t.data_ptr() for r, ps in self.params.items() for n, t in ps.items()}

    def mismatches(self, ref: dict[str, torch.Tensor]) -> list[str]:
        """Every piece of every parameter whose bytes differ from the reference's box."""
        bad = []
        for p in self.puller.params():
            flat = self.params[p.rank][p.name].view(torch.uint8).reshape(-1)
            for pc in p.pieces:
                box = _box(pc.box_offset, pc.box_shape)
                want = ref[pc.tensor][box].contiguous().view(torch.uint8).reshape(-1)
                if not torch.equal(flat[pc.offset : pc.offset + want.numel()], want):
                    bad.append(f"rank {p.rank} {p.name} <- {pc.tensor}{list(pc.box_offset)}")
        return bad

    def addresses_unchanged(self) -> bool:
        now = {(r, n): t.data_ptr() for r, ps in self.params.items() for n, t in ps.items()}
        regs = {(r, n): a for r in self.params for n, a in self.puller.addresses(r).items()}
        return now == self.ptrs == regs


@pytest.fixture
def fleet(control_plane, model, weights):
    """Two fsdp:2 trainer slots and one engine (worker ``engine-0``) holding all tp:3 ranks."""
    trainer = Trainer(control_plane.url, model, weights)
    engine = Engine(control_plane.url, model, worker_id="engine-0")
    try:
        yield trainer, engine
    finally:
        engine.puller.close()
        trainer.close()


def _declare(control: mx.Control, label: str, weights) -> None:
    control.declare(label, weights, trainer_layout="fsdp:2")


def test_in_place_publish_stage_apply_rollback_byte_exact(fleet, control, weights):
    trainer, engine = fleet
    _declare(control, "v1", weights)
    v1 = trainer.publish("v1")
    ref1 = trainer.full()
    staged = engine.puller.stage("v1")
    assert (staged.label, staged.version_id, staged.resident) == ("v1", v1, False)
    # Staging does not touch the engine's tensors.
    untouched = [t for ps in engine.params.values() for t in ps.values()]
    assert all(torch.isnan(t.float()).all() for t in untouched)
    applied = engine.puller.apply()
    assert (applied.version_id, applied.kind) == (v1, "staged")
    assert engine.mismatches(ref1) == []
    # Pulled bytes equal what the slots hold: each rank holds exactly its layout's bytes.
    mem = engine.puller.memory_report()
    total = sum(p.nbytes for p in engine.puller.params())
    assert sum(mem.rank_bytes.values()) == total
    assert 0 < mem.staging_bytes_peak <= total
    # This process holds the engine's tensors and staging (both written): its resident set
    # counts them, and its peak is at least what it holds now.
    assert mem.process_rss_bytes_peak >= mem.process_rss_bytes >= total + mem.staging_bytes

    # The trainer hands v1 back, steps in place and publishes v2 from the same memory.
    for p in trainer.pubs:
        p.release("v1", timeout=30)
    trainer.step(0.5)
    _declare(control, "v2", weights)
    v2 = trainer.publish("v2")
    assert v2 != v1
    ref2 = trainer.full()
    assert engine.puller.stage(v2).label == "v2"  # by id
    assert engine.puller.apply(v2).kind == "staged"
    assert engine.mismatches(ref2) == []
    assert engine.puller.versions == mx.Versions(resident=v2, retained=v1, staged=v2)
    assert engine.puller.memory_report().retained_bytes == total

    back = engine.puller.rollback()
    assert (back.version_id, back.kind) == (v1, "restored")
    assert engine.puller.versions == mx.Versions(resident=v1, retained=v1, staged=v2)
    assert engine.mismatches(ref1) == []
    assert engine.puller.apply(v2).kind == "staged"
    assert engine.mismatches(ref2) == []
    assert engine.addresses_unchanged()
    digests = engine.puller.live_digests()
    assert sorted(digests) == [0, 1, 2]
    assert {n for d in digests.values() for n in d} == {p.name for p in engine.puller.params()}


def test_copy_mode_lets_the_trainer_write_at_once(fleet, control, weights):
    trainer, engine = fleet
    _declare(control, "v1", weights)
    v1 = trainer.publish("v1", copy=True)
    ref1 = trainer.full()
    trainer.step(-1.0)  # written before anyone pulled: the snapshot keeps v1
    engine.puller.stage(v1)
    engine.puller.apply()
    assert engine.mismatches(ref1) == []
    assert engine.mismatches(trainer.full()) != []


def test_staged_tensors_hand_the_pieces_to_an_engine_loader(fleet, control, weights):
    trainer, engine = fleet
    _declare(control, "v1", weights)
    trainer.publish("v1")
    engine.puller.stage("v1")
    pieces = engine.puller.staged_tensors()
    ref = trainer.full()
    expected = sum(len(p.pieces) for p in engine.puller.params())
    assert len(pieces) == expected
    for s in pieces:
        box = _box(s.box_offset, s.box_shape)
        want = ref[s.tensor][box].contiguous().view(torch.uint8).reshape(-1)
        assert bytes(want.numpy()) == s.data, (s.rank, s.param, s.tensor)
    # Nothing was applied: the engine's tensors are untouched.
    assert engine.puller.versions.resident is None


def test_retention_in_staging_exchanges_instead_of_copying(control_plane, control, model, weights):
    """``retain="in_staging"``: an apply exchanges staging and the engine's tensors, so the
    version resident before is retained in staging, with no buffer of its own; a rollback is the
    exchange back (the version rolled back from staged again); the tensors never move. One
    rank, as a vLLM worker holds (three ranks in one puller read each replicated norm's staging
    bytes three times: those plans apply by copy)."""
    trainer = Trainer(control_plane.url, model, weights)
    engine = Engine(
        control_plane.url, model, ranks=(1,), worker_id="engine-swap", retain="in_staging"
    )
    try:
        _declare(control, "v1", weights)
        v1 = trainer.publish("v1")
        ref1 = trainer.full()
        engine.puller.stage(v1)
        assert engine.puller.apply().kind == "staged"
        assert engine.mismatches(ref1) == []
        for p in trainer.pubs:
            p.release("v1", timeout=30)
        trainer.step(0.5)
        _declare(control, "v2", weights)
        v2 = trainer.publish("v2")
        ref2 = trainer.full()
        engine.puller.stage(v2)
        a = engine.puller.apply(v2)
        assert (a.kind, a.retained) == ("staged", v1)
        assert engine.mismatches(ref2) == []
        assert engine.puller.versions == mx.Versions(resident=v2, retained=v1, staged=None)
        mem = engine.puller.memory_report()
        assert mem.retained_bytes == 0 and mem.staging_bytes > 0, mem
        back = engine.puller.rollback()
        assert (back.version_id, back.kind) == (v1, "restored")
        assert engine.mismatches(ref1) == []
        assert engine.puller.versions == mx.Versions(resident=v1, retained=None, staged=v2)
        assert engine.puller.apply(v2).kind == "staged"
        assert engine.mismatches(ref2) == []
        moved = [k for k, t in _tensors(engine) if t.data_ptr() != engine.ptrs[k]]
        assert moved == []
    finally:
        engine.puller.close()
        trainer.close()
    with pytest.raises(ValueError, match="in_staging"):
        mx.Puller(None, model=model, layout="tp:3", ranks=[0], retain="staging")


def _tensors(engine):
    return [((r, n), t) for r, ps in engine.params.items() for n, t in ps.items()]


def test_copy_staged_hands_a_rank_as_apply_would_write_it(fleet, control, weights):
    trainer, engine = fleet
    _declare(control, "v1", weights)
    v1 = trainer.publish("v1")
    engine.puller.stage("v1")
    infos = engine.puller.params(0)
    buf = torch.full((max(p.offset + p.nbytes for p in infos),), 0xA5, dtype=torch.uint8)
    engine.puller.copy_staged(v1, 0, buf)
    # Window by window (one parameter each, into garbage): the same bytes.
    windows = torch.full_like(buf, 0x5A)
    for p in infos:
        w = torch.full((p.nbytes,), 0x3C, dtype=torch.uint8)
        engine.puller.copy_staged(v1, 0, w, offset=p.offset)
        windows[p.offset : p.offset + p.nbytes] = w
    # Nothing was applied, nothing else moved: the version is still only staged.
    assert engine.puller.versions.resident is None
    assert engine.puller.versions.staged == v1
    engine.puller.apply()
    for p in infos:
        live = engine.params[0][p.name].contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(buf[p.offset : p.offset + p.nbytes], live), p.name
        assert torch.equal(windows[p.offset : p.offset + p.nbytes], live), p.name
    other = "mx:" + "ab" * 32
    with pytest.raises(mx.MxError) as e:
        engine.puller.copy_staged(other, 0, buf)
    assert e.value.code == "NotFound" and other in str(e.value)
    with pytest.raises(mx.MxError) as e:
        engine.puller.copy_staged(v1, 0, buf[:8], offset=buf.numel() - 4)
    assert e.value.code == "InvalidArgument", e.value
    with pytest.raises(ValueError):
        engine.puller.copy_staged(v1, 0, buf[:8], offset=-1)
    read_only = np.frombuffer(bytes(buf.numel()), dtype=np.uint8)
    with pytest.raises(mx.MxError) as e:
        engine.puller.copy_staged(v1, 0, read_only)
    assert e.value.code == "InvalidArgument", e.value


def test_served_puller_is_refitted_by_the_control_plane(fleet, control, weights):
    trainer, engine = fleet
    url = engine.puller.serve("engine-0")
    assert url.startswith("http://127.0.0.1:")
    _declare(control, "v1", weights)
    v1 = trainer.publish("v1")
    r = control.refit("v1", ["engine-0"], stage_timeout=60, call_timeout=30)
    assert r.committed, r
    assert r.workers["engine-0"].resident == v1
    assert engine.mismatches(trainer.full()) == []
    # STAGE released v1 to the trainer.
    why = trainer.pubs[0].wait_staged("v1", timeout=30)
    assert "Staged" in why and why["Staged"]["workers"] == ["engine-0"]
    assert engine.addresses_unchanged()
    # Served: staging, applying and rolling back are the control plane's.
    _refused(lambda: engine.puller.apply(), "FailedPrecondition", "served")
    _refused(lambda: engine.puller.rollback(), "FailedPrecondition", "served")
    _refused(lambda: engine.puller.stage("v1"), "FailedPrecondition", "served")

    # An engine tensor reallocated behind the served puller's back: the next refit fails
    # before writing anything into freed memory, naming the parameter.
    for p in trainer.pubs:
        p.wait_staged("v1", timeout=30)
    trainer.step(0.5)
    _declare(control, "v2", weights)
    trainer.publish("v2")
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    engine.params[2][qkv].resize_(4096, H)
    r = control.refit("v2", ["engine-0"], stage_timeout=60, call_timeout=30)
    assert not r.committed, r
    w = r.workers["engine-0"]
    err = f"{w.error} " + " ".join(c.error for c in w.calls)
    assert qkv in err and "changed since it was registered" in err, err


# --- an engine URL proves nothing: the engine says whose it is ------------------------------


class _Proxy:
    """A TCP forwarder on a loopback port of its own to ``port``: a spelling of an engine's URL
    that no address comparison can see through."""

    def __init__(self, port: int) -> None:
        import socket

        self._target = port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()


def test_status_shows_publishers_live_then_silent_once_one_exits(fleet, control, weights):
    """A trainer rank that exited reads as silent within seconds (its layout watcher stopped
    naming its NIXL agent), while the one still serving stays live; a worker with nothing
    resident is gated ``no_weights``."""
    trainer, _ = fleet
    _declare(control, "v1", weights)
    trainer.publish("v1")
    v = control.status().version("v1")
    assert v.slots == 2 and [p["slot"] for p in v.publishers] == [0, 1]
    assert [p["liveness"] for p in v.publishers] == ["live", "live"], v.publishers
    assert all(p["last_seen_ms"] < 3000 and p["retired_by"] is None for p in v.publishers)
    assert v.peers == () and v.artifacts == () and v.release is None
    w = control.status().worker("engine-0")
    assert (w.admitted, w.gate, w.resident_label) == (False, "no_weights", None)

    trainer.pubs[1].close()
    deadline = time.monotonic() + 10
    while True:
        pubs = control.status().version("v1").publishers
        if pubs[1]["liveness"] == "silent":
            break
        assert time.monotonic() < deadline, pubs
        time.sleep(0.2)
    assert pubs[1]["last_seen_ms"] > 3000, pubs
    assert pubs[0]["liveness"] == "live" and pubs[0]["last_seen_ms"] < 3000, pubs


def _get(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_another_worker_id_cannot_reach_a_live_workers_engine(fleet, control, model, weights):
    """Issue 29, item 1: a worker id registered with w0's engine spelled differently was
    accepted, and a refit of it paused, installed and committed on w0's engine. Every spelling
    of the same address is refused at registration; a proxy (which no address check sees
    through) gets as far as the refit, where the engine says it is w0's and nothing is sent."""
    trainer, engine = fleet
    url = engine.puller.serve("engine-0")
    port = int(url.rsplit(":", 1)[1])
    ident = engine.puller.engine_identity()
    assert ident is not None and ident["worker_id"] == "engine-0", ident
    assert len(ident["incarnation_digest"]) == 32
    assert _get(f"{url}/mx/identity") == {"engines": [ident]}
    _declare(control, "v1", weights)
    v1 = trainer.publish("v1")
    assert control.refit("v1", ["engine-0"], stage_timeout=60, call_timeout=30).committed

    other = Engine(control.url, model, worker_id="x")
    proxy = _Proxy(port)
    try:
        for alias in (
            f"http://localhost:{port}",
            f"http://127.0.0.1:{port}/",
            f"http://127.1:{port}",
            f"http://[::ffff:127.0.0.1]:{port}",
            f"http://127.0.0.1:0{port}",
            f"http://0x7f000001:{port}",
        ):
            msg = _refused(
                lambda a=alias: other.puller.follow(
                    "x", instance="x", engine_url=a, engine_api="dynamo"
                ),
                "AlreadyExists",
                '"engine-0"',
                f"loopback:{port}",
            )
            assert "one engine cannot serve two worker ids" in msg, msg
        # Through the proxy the registration is accepted; the refit is refused at its first
        # engine call, before anything is sent.
        other.puller.follow(
            "x", instance="x", engine_url=f"http://127.0.0.1:{proxy.port}", engine_api="dynamo"
        )
        for p in trainer.pubs:
            p.wait_staged("v1", timeout=30)
        trainer.step(0.25)
        _declare(control, "v2", weights)
        trainer.publish("v2")
        r = control.refit("v2", ["x"], stage_timeout=60, call_timeout=30)
        assert r.outcome is mx.Outcome.ABORTED, r
        calls = r.workers["x"].calls
        assert [c.action for c in calls] == ["pause"], calls
        assert "says it serves engine-0 of instance engine-0, not worker x" in calls[0].error
        # engine-0 was never paused nor changed, and stays admitted on v1.
        assert _get(f"{url}/engine/get_weight_version")["version"] == v1
        w0 = next(w for w in control.status().workers if w.worker_id == "engine-0")
        assert w0.admitted and w0.resident_id == v1, w0
        assert engine.mismatches(trainer.full()) != []  # it holds v1, not the stepped v2
    finally:
        proxy.close()
        other.puller.close()


def test_an_engine_another_worker_ids_refit_reached_is_read_back(
    control_plane, control, model, weights, tmp_path
):
    """Issue 29, item 1: workers whose engines share an address (the ranks of one instance,
    or an id registered while the engine's own worker was away) are not trusted on what they
    report after a refit called that engine for another id: the control plane reads the
    engine's version back itself, journals it, and admits on that."""
    trainer = Trainer(control_plane.url, model, weights)
    w = Engine(control_plane.url, model, ranks=(0, 1), worker_id="w")
    x = Engine(control_plane.url, model, ranks=(2,), worker_id="x")
    try:
        url = w.puller.serve("w")
        port = int(url.rsplit(":", 1)[1])
        _declare(control, "v1", weights)
        v1 = trainer.publish("v1")
        assert control.refit("v1", ["w"], stage_timeout=60, call_timeout=30).committed
        # x: rank 2 of the same instance, its engine w's spelled another way (siblings share).
        x.puller.follow(
            "x", instance="w", engine_url=f"http://localhost:{port}/", engine_api="dynamo"
        )
        for p in trainer.pubs:
            p.wait_staged("v1", timeout=30)
        trainer.step(0.5)
        _declare(control, "v2", weights)
        trainer.publish("v2")
        r = control.refit("v2", ["x"], stage_timeout=60, call_timeout=30)
        # The engine says it serves w only: nothing is sent for x.
        assert r.outcome is mx.Outcome.ABORTED, r
        assert "says it serves w of instance w, not worker x" in r.workers["x"].calls[0].error
        # w was gated from the refit's BEGIN; its engine is read back once it ended.
        deadline = time.monotonic() + 15
        while True:
            st = next(s for s in control.status().workers if s.worker_id == "w")
            if st.admitted or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert st.admitted and st.resident_id == v1, st
        journal = (tmp_path / "control" / "journal.jsonl").read_text().splitlines()
        records = [json.loads(line)["record"] for line in journal]
        backs = [rec for rec in records if rec["op"] == "read_back"]
        assert [(b["worker_id"], b["refit"], b["resident_version"]) for b in backs] == [
            ("w", r.refit_id, v1)
        ], backs
        # Marked at BEGIN (x's refit), read back after its END.
        ops = [(rec["op"], rec.get("id", rec.get("refit"))) for rec in records]
        assert ops.index(("refit_end", r.refit_id)) < ops.index(("read_back", r.refit_id)), ops
    finally:
        x.puller.close()
        w.puller.close()
        trainer.close()


# --- bad tensors are refused, naming them -------------------------------------------------


def _publisher(control_plane, model) -> mx.Publisher:
    return mx.Publisher(control_plane.url, model=model, layout="fsdp:2", slot=0)


NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"


def _refused(fn, code: str, *needles: str) -> str:
    with pytest.raises(mx.MxError) as e:
        fn()
    assert e.value.code == code, (e.value.code, str(e.value))
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return str(e.value)


def test_publisher_refuses_bad_shards_naming_the_tensor(control_plane, model, weights):
    pub = _publisher(control_plane, model)
    try:
        f32 = torch.zeros(H, dtype=torch.float32)
        f16 = torch.zeros(H, dtype=torch.float16)
        _refused(lambda: pub.set_shards({NORM: f16}), "InvalidArgument", NORM, "dtype")
        wide = torch.zeros(VOCAB, H + 1, dtype=torch.bfloat16)
        _refused(lambda: pub.set_shards({EMBED: wide}), "InvalidArgument", EMBED)
        outside = torch.zeros(VOCAB // 2, H, dtype=torch.bfloat16)
        _refused(
            lambda: pub.set_shards({EMBED: (outside, [VOCAB // 2 + 1, 0])}),
            "InvalidArgument",
            EMBED,
        )
        strided = torch.zeros(H, VOCAB, dtype=torch.bfloat16).t()
        _refused(lambda: pub.set_shards({EMBED: strided}), "InvalidArgument", EMBED, "contiguous")
        _refused(
            lambda: pub.set_shards({"model.nope.weight": f32}), "InvalidArgument", "model.nope"
        )
        meta = torch.zeros(H, dtype=torch.float32, device="meta")
        _refused(lambda: pub.set_shards({NORM: meta}), "InvalidArgument", NORM, "meta")
        _refused(lambda: pub.publish("v1", timeout=1), "FailedPrecondition", "no shards")
    finally:
        pub.close()


def test_publisher_refuses_bad_offsets_and_empty_shards(control_plane, model):
    pub = _publisher(control_plane, model)
    try:
        q = "model.layers.0.self_attn.q_proj.weight"
        t = torch.zeros(HEADS * HEAD_DIM // 2, H, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="offset has 1 dims, the tensor has 2"):
            pub.set_shards([mx.Shard(q, t, [0])])
        with pytest.raises(ValueError, match=r"offset\[0\] = -1"):
            pub.set_shards([mx.Shard(q, t, [-1, 0])])
        with pytest.raises(ValueError, match="outside"):
            pub.set_shards([mx.Shard(q, t, [2**64, 0])])
        with pytest.raises(TypeError, match=r"offset\[1\] must be an int"):
            pub.set_shards([mx.Shard(q, t, [0, 1.5])])
        empty = torch.zeros(0, H, dtype=torch.bfloat16)
        _refused(lambda: pub.set_shards([mx.Shard(q, empty, [0, 0])]), "InvalidArgument", q)
        # numpy ints are ints
        pub.set_shards([mx.Shard(q, t, [np.int64(0), np.int32(0)])])
        _refused(lambda: pub.wait_staged("no-such-label", timeout=30), "NotFound", "no-such")
    finally:
        pub.close()


def test_publisher_refuses_a_tensor_changed_after_registration(control_plane, model, weights):
    pub = _publisher(control_plane, model)
    try:
        norm = torch.ones(H // 2, dtype=torch.float32)
        pub.set_shards({NORM: norm})
        norm.resize_(2 * H)  # reallocates the storage mx registered
        msg = _refused(lambda: pub.publish("v1", timeout=1), "FailedPrecondition", NORM)
        assert "changed since it was registered" in msg
        norm2 = torch.ones(H // 2, dtype=torch.float32)
        pub.set_shards({NORM: norm2})
        norm2.data = torch.zeros(H // 2, dtype=torch.float32)  # re-pointed
        _refused(lambda: pub.publish("v1", timeout=1), "FailedPrecondition", NORM, "address")
    finally:
        pub.close()


def test_publisher_takes_numpy_dlpack_and_byte_buffers(control_plane, control, model, weights):
    """Slot 0 publishes one tensor from a numpy array, one through DLPack only and one from an
    untyped byte buffer (rows inferred from its length); the engine gets every byte."""
    halves: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, t in weights.items():
        for slot in range(2):
            lo, hi = _rows(t, slot)
            halves[slot][name] = t[lo:hi].clone()
    pubs = [mx.Publisher(control_plane.url, model=model, layout="fsdp:2", slot=s) for s in range(2)]
    engine = Engine(control_plane.url, model, worker_id="engine-0")
    try:
        ln0 = "model.layers.0.input_layernorm.weight"
        shards0 = []
        for name, t in halves[0].items():
            if name == NORM:
                shards0.append(mx.Shard(name, _DLPackOnly(t), [0]))
            elif name == ln0:
                shards0.append(mx.Shard(name, t.numpy(), [0]))
            elif name == EMBED:
                shards0.append(mx.Shard(name, bytearray(t.view(torch.uint8).numpy()), [0, 0]))
            else:
                shards0.append(mx.Shard(name, t, [0] * t.dim()))
        pubs[0].set_shards(shards0)
        # A uint16 array for a BF16 tensor: the dtype differs from the model's.
        as_u16 = halves[1][EMBED].view(torch.int16).numpy().view(np.uint16)
        _refused(
            lambda: pubs[1].set_shards({EMBED: (as_u16, [VOCAB // 2, 0])}),
            "InvalidArgument",
            EMBED,
            "dtype",
        )
        _refused(
            lambda: pubs[1].set_shards({EMBED: (bytearray(10), [VOCAB // 2, 0])}),
            "InvalidArgument",
            EMBED,
            "bytes",
        )
        pubs[1].set_shards(
            {n: (t, [_rows(weights[n], 1)[0]] + [0] * (t.dim() - 1)) for n, t in halves[1].items()}
        )
        control.declare("v1", weights, trainer_layout="fsdp:2")
        ids: list[str] = []
        threads = [
            threading.Thread(target=lambda p=p: ids.append(p.publish("v1", timeout=60)))
            for p in pubs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert len(ids) == 2 and ids[0] == ids[1]
        engine.puller.stage("v1")
        engine.puller.apply()
        ref = {n: torch.cat([halves[0][n], halves[1][n]]) for n in weights}
        assert engine.mismatches(ref) == []
    finally:
        engine.puller.close()
        for p in pubs:
            p.close()


class _DLPackOnly:
    """An object that offers its memory only through DLPack (like a JAX or CuPy array)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def test_puller_refuses_bad_tensors_naming_the_parameter(control_plane, model):
    pull = mx.Puller(control_plane.url, model=model, layout="tp:3", ranks=[1])
    try:
        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
        params = {p.name: torch.zeros(p.shape, dtype=dtypes[p.dtype]) for p in pull.params(1)}
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert qkv in params and params[qkv].shape == ((HEADS + 2 * KV) * HEAD_DIM // 3, H)
        wrong = dict(params, **{qkv: params[qkv].half()})
        _refused(lambda: pull.register(1, wrong), "InvalidArgument", "rank 1", qkv, "F16")
        short = dict(params, **{qkv: params[qkv][:-1].clone()})
        _refused(lambda: pull.register(1, short), "InvalidArgument", qkv, "layout says")
        strided = dict(params, **{qkv: torch.zeros(H, params[qkv].shape[0]).bfloat16().t()})
        _refused(lambda: pull.register(1, strided), "InvalidArgument", qkv, "contiguous")
        missing = {n: t for n, t in params.items() if n != qkv}
        _refused(lambda: pull.register(1, missing), "InvalidArgument", qkv)
        ro = np.zeros(params["model.norm.weight"].numel(), dtype=np.float32)
        ro.flags.writeable = False
        readonly = dict(params, **{"model.norm.weight": ro})
        _refused(lambda: pull.register(1, readonly), "InvalidArgument", "read-only")
        _refused(lambda: pull.register(0, params), "InvalidArgument", "rank 0")
        _refused(lambda: pull.apply(), "FailedPrecondition", "nothing is staged")

        ln = params["model.layers.0.input_layernorm.weight"]
        twice = dict(params, **{"model.norm.weight": ln})
        _refused(lambda: pull.register(1, twice), "InvalidArgument", "overlaps")
        pull.close()
        pull = mx.Puller(control_plane.url, model=model, layout="tp:3", ranks=[1])
        pull.register(1, params)
        params[qkv].resize_(1)
        _refused(lambda: pull.apply(), "FailedPrecondition", qkv, "changed since")
    finally:
        pull.close()
    _refused(lambda: pull.versions, "FailedPrecondition", "closed")
    for ranks, needle in (([3], "rank 3"), ([], "no rank"), ([1, 1], "twice")):
        _refused(
            lambda r=ranks: mx.Puller(None, model=model, layout="tp:3", ranks=r),
            "InvalidArgument",
            needle,
        )
    with pytest.raises(ValueError, match="worker_id needs a control plane"):
        mx.Puller(None, model=model, layout="tp:3", ranks=[0], worker_id="w")


_FORK_SCRIPT = """
import json, os, sys, time
import mx
config, tensors, journal = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
model = mx.Model.from_config(config, [tuple(t) for t in tensors])
cp = mx.ControlPlane(journal)
control = mx.Control(cp.url)
pub = mx.Publisher(cp.url, model=model, layout="fsdp:2", slot=0)
pull = mx.Puller(cp.url, model=model, layout="tp:3", ranks=[0])
pid = os.fork()
if pid == 0:
    try:
        control.status()
        sys.exit(3)
    except mx.MxError as e:
        if e.code != "FailedPrecondition" or "fork" not in str(e):
            sys.exit(4)
    sys.exit(0)  # a normal exit: finalization drops every mx object in the child
t0 = time.monotonic()
while time.monotonic() - t0 < 30:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    print("child hung", flush=True)
"""


def test_a_fork_child_holding_mx_objects_exits(tmp_path, model):
    """A fork child has none of the parent's runtime threads: using mx objects there is a
    clear error, and dropping them at exit must not wait for those threads (it would hang)."""
    import json
    import subprocess
    import sys

    tensors = [[t.name, t.dtype, list(t.shape)] for t in model.tensors]
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, json.dumps(CONFIG), json.dumps(tensors)]
        + [str(tmp_path / "journal.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "child exit 0" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_tensors_carved_back_to_back_from_one_buffer_publish_in_place(control, model, weights):
    """Tensors that are adjacent, unaligned storages carved out of one buffer (what safetensors'
    ``load_file`` returns) are published in place and pulled byte-exact into every tp rank: the
    puller coalesces READs across adjacent tensors, so they must lie in one registration."""
    raw = bytearray(sum(t.numel() * t.element_size() for t in weights.values()) + 6)
    view = memoryview(raw)
    carved, off = {}, 6  # not page-aligned, as safetensors' header makes it
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        c = torch.frombuffer(view[off : off + n], dtype=t.dtype).view(t.shape)
        c.copy_(t)
        carved[name] = c
        off += n
    storages = sorted(
        (c.untyped_storage().data_ptr(), c.untyped_storage().nbytes()) for c in carved.values()
    )
    assert len(storages) == len(carved)  # one storage per tensor, back to back
    assert all(a + n == b for (a, n), (b, _) in zip(storages, storages[1:], strict=False))
    pub = mx.Publisher(control.url, model=model, layout="replicated:1", slot=0)
    engine = Engine(control.url, model, worker_id="engine-0")
    try:
        pub.set_shards(carved)
        control.declare("v1", weights, trainer_layout="replicated:1")
        pub.publish("v1", timeout=60)  # in place
        engine.puller.stage("v1")
        engine.puller.apply()
        assert engine.mismatches(weights) == []
    finally:
        engine.puller.close()
        pub.close()
