"""The control plane embedded in Python, driven over real gRPC by mx.Control."""

from __future__ import annotations

import threading
import time

import pytest

import mx

TENSORS = {"w": ("BF16", (4, 8)), "b": ("F32", (8,))}


def test_declare_then_status_shows_the_version(control_plane, control):
    assert control_plane.running
    assert control_plane.url.startswith("http://127.0.0.1:")
    assert not control_plane.url.endswith(":0")
    control.declare("v1", TENSORS, trainer_layout="fsdp:2")
    s = control.status()
    assert isinstance(s, mx.FleetStatus)
    v = s.version("v1")
    assert v == mx.VersionSummary("v1", mx.VersionState.DECLARED, None, slots=2)
    assert v.publishers == () and v.release is None
    assert s.workers == () and s.admitted == ()
    assert s.fleet_version is None and s.open_refit is None
    info = control.version("v1")
    assert info.state is mx.VersionState.DECLARED
    assert info.missing_slots == (0, 1) and info.published_slots == ()
    assert info.version_id is None
    # Identical again: idempotent. Different: refused, naming what differs.
    control.declare("v1", TENSORS, trainer_layout="fsdp:2")
    with pytest.raises(mx.MxError, match="already declared differently") as e:
        control.declare("v1", {"w": ("BF16", (4, 9))}, trainer_layout="fsdp:2")
    assert e.value.code == "AlreadyExists"


def test_refit_with_an_empty_worker_set_is_refused(control):
    control.declare("v1", TENSORS, trainer_layout="fsdp:1")
    with pytest.raises(mx.MxError, match="empty worker set") as e:
        control.refit("v1", [])
    assert e.value.code == "InvalidArgument"
    assert "worker_ids" in str(e.value)


def test_refit_of_a_version_that_is_not_ready_is_refused(control):
    control.declare("v1", TENSORS, trainer_layout="fsdp:1")
    with pytest.raises(mx.MxError, match="a refit needs a READY version") as e:
        control.refit("v1", ["w0"])
    assert e.value.code == "FailedPrecondition"
    with pytest.raises(mx.MxError, match='"nope" is not declared') as e:
        control.refit("nope", ["w0"])
    assert e.value.code == "NotFound"
    with pytest.raises(mx.MxError, match="no refit was started") as e:
        control.wait_refit(timeout=0.5)
    assert e.value.code == "NotFound"


def test_bad_arguments_raise_clear_errors(control_plane, control):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        control.status(timeout=-1)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        control.wait_version("v1", timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        mx.Control(control_plane.url, timeout=float("nan"))
    with pytest.raises(ValueError, match="stage_timeout must be a positive"):
        control.refit("v1", ["w0"], stage_timeout=-5)
    with pytest.raises(ValueError, match="pause_mode"):
        control.refit("v1", ["w0"], pause_mode="sometimes")
    with pytest.raises(TypeError, match="not one str"):
        control.refit("v1", "w0")
    with pytest.raises(TypeError, match="worker id must be a str"):
        control.refit("v1", ["w0", 7])
    with pytest.raises(TypeError):
        control.status(timeout="soon")
    with pytest.raises(TypeError, match="url must be a str"):
        mx.Control(8080)
    with pytest.raises(ValueError, match="label must be a non-empty string"):
        control.declare("", TENSORS, trainer_layout="fsdp:1")
    with pytest.raises(TypeError, match="not a str"):
        control.declare("v1", "w", trainer_layout="fsdp:1")
    with pytest.raises(TypeError, match="shape must be a sequence of ints"):
        control.declare("v1", {"w": ("BF16", 4)}, trainer_layout="fsdp:1")
    with pytest.raises(ValueError, match="negative dimension"):
        control.declare("v1", {"w": ("BF16", (4, -1))}, trainer_layout="fsdp:1")
    with pytest.raises(ValueError, match="refit_id must be >= 0"):
        control.wait_refit(-1)
    with pytest.raises(ValueError, match="state must be one of"):
        control.wait_version("v1", "DONE", timeout=1)
    with pytest.raises(mx.MxError, match='tensor w: dtype: unknown dtype "bf17"') as e:
        control.declare("v1", {"w": ("bf17", (4,))}, trainer_layout="fsdp:1")
    assert e.value.code == "InvalidArgument"
    with pytest.raises(mx.MxError, match="trainer_layout") as e:
        control.declare("v1", TENSORS, trainer_layout="fsdp")
    with pytest.raises(ValueError, match="listen must be HOST:PORT"):
        mx.ControlPlane(journal="/tmp/unused", listen="no port here")
    # Nothing was declared by any of the above.
    assert control.status().versions == ()


def test_wait_version_times_out_with_the_state_it_saw(control):
    control.declare("v1", TENSORS, trainer_layout="fsdp:1")
    t = time.monotonic()
    with pytest.raises(mx.MxError, match=r'"v1" did not reach READY \(now DECLARED\)') as e:
        control.wait_version("v1", mx.VersionState.READY, timeout=1.5)
    assert e.value.code == "DeadlineExceeded"
    assert 1.2 < time.monotonic() - t < 8


def test_the_gil_is_released_during_a_blocking_wait(control):
    control.declare("v1", TENSORS, trainer_layout="fsdp:1")
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.005)

    th = threading.Thread(target=count)
    th.start()
    try:
        time.sleep(0.05)
        before = ticks
        t = time.monotonic()
        with pytest.raises(mx.MxError):
            control.wait_version("v1", "COMMITTED", timeout=2.0)
        waited = time.monotonic() - t
        during = ticks - before
    finally:
        stop.set()
        th.join()
    assert waited >= 1.5
    # ~400 ticks of 5 ms in 2 s when the GIL is free; a held GIL would allow about none.
    assert during > 100, f"only {during} ticks in {waited:.2f} s: the GIL was held"


def test_calls_from_several_threads_at_once(control):
    control.declare("v1", TENSORS, trainer_layout="fsdp:1")
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(20):
                assert control.status().version("v1") is not None
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors


def test_the_journal_survives_a_restart(tmp_path):
    journal = tmp_path / "j" / "journal.jsonl"
    with mx.ControlPlane(journal=journal) as cp:
        mx.Control(cp.url).declare("v1", TENSORS, trainer_layout="fsdp:2")
        url = cp.url
    assert not cp.running
    cp.stop()  # idempotent
    assert journal.stat().st_size > 0
    with pytest.raises(mx.MxError) as e:
        mx.Control(url, timeout=3).status()
    assert e.value.code in ("Unavailable", "DeadlineExceeded"), e.value
    with mx.ControlPlane(journal=journal) as cp2:
        s = mx.Control(cp2.url).status()
        assert [v.label for v in s.versions] == ["v1"]


def test_a_corrupt_journal_refuses_the_start(tmp_path):
    journal = tmp_path / "journal.jsonl"
    journal.write_text("this is not a journal line\nnor this\n")
    with pytest.raises(mx.MxError, match="journal") as e:
        mx.ControlPlane(journal=journal)
    assert str(journal) in str(e.value)


def test_a_busy_port_is_an_mx_error(control_plane, tmp_path):
    with pytest.raises(mx.MxError, match="cannot listen on") as e:
        mx.ControlPlane(journal=tmp_path / "other.jsonl", listen=control_plane.address)
    assert "in use" in str(e.value).lower()


def test_connecting_to_nothing_fails_fast():
    t = time.monotonic()
    with pytest.raises(mx.MxError) as e:
        mx.Control("http://127.0.0.1:1", timeout=3).status()
    assert e.value.code in ("Unavailable", "DeadlineExceeded"), e.value
    assert "127.0.0.1:1" in str(e.value)
    assert time.monotonic() - t < 10


def test_tokens_roles_and_metrics_of_the_embedded_control_plane(tmp_path, monkeypatch):
    import urllib.request

    orch, reader = "o" * 32, "r" * 32
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{orch},orchestrator,driver\n{reader},reader,dash\n")
    with mx.ControlPlane(
        journal=tmp_path / "journal.jsonl", tokens=tokens, metrics="127.0.0.1:0"
    ) as cp:
        monkeypatch.delenv("MX_CONTROL_TOKEN_FILE", raising=False)
        monkeypatch.delenv("MX_CONTROL_TOKEN", raising=False)
        with pytest.raises(mx.MxError) as e:
            mx.Control(cp.url).status()
        assert e.value.code == "Unauthenticated", e.value
        monkeypatch.setenv("MX_CONTROL_TOKEN", reader)
        assert mx.Control(cp.url).status().versions == ()
        with pytest.raises(mx.MxError) as e:
            mx.Control(cp.url).declare("v1", TENSORS, trainer_layout="fsdp:1")
        assert e.value.code == "PermissionDenied", e.value
        monkeypatch.setenv("MX_CONTROL_TOKEN", orch)
        mx.Control(cp.url).declare("v1", TENSORS, trainer_layout="fsdp:1")
        assert cp.metrics_url is not None and cp.metrics_url.endswith("/metrics")
        page = urllib.request.urlopen(cp.metrics_url, timeout=10).read().decode()
        assert 'mx_versions{state="declared"} 1' in page, page
        assert 'code="permission_denied"' in page and 'method="DeclareVersion"' in page, page
        ready = cp.metrics_url.replace("/metrics", "/ready")
        assert urllib.request.urlopen(ready, timeout=10).status == 200


def test_each_client_of_one_process_presents_its_own_token(tmp_path, monkeypatch):
    """A trainer rank holds two roles (publisher and orchestrator) and a process has one
    MX_CONTROL_TOKEN: Control and Publisher take a token (or token file) of their own, which
    wins over the process's; the CA still comes from the environment."""
    orch, pub, worker = "o" * 32, "p" * 32, "w" * 32
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{orch},orchestrator,driver\n{pub},publisher,rank0,0\n{worker},worker,w,*\n")
    (tmp_path / "orch").write_text(orch + "\n")
    (tmp_path / "short").write_text("abc\n")
    import torch

    h, v, f = 8, 16, 16  # a one-layer llama: 2 heads of 4, 1 KV head
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (h, h),
        "model.layers.0.self_attn.k_proj.weight": (4, h),
        "model.layers.0.self_attn.v_proj.weight": (4, h),
        "model.layers.0.self_attn.o_proj.weight": (h, h),
        "model.layers.0.mlp.gate_proj.weight": (f, h),
        "model.layers.0.mlp.up_proj.weight": (f, h),
        "model.layers.0.mlp.down_proj.weight": (h, f),
    }
    weights = {n: torch.full(s, 0.5, dtype=torch.bfloat16) for n, s in shapes.items()}
    config = {
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "intermediate_size": f,
        "vocab_size": v,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    model = mx.Model.from_config(config, weights)
    with mx.ControlPlane(journal=tmp_path / "journal.jsonl", tokens=tokens) as cp:
        # The process's own token is a worker's: it may neither declare nor publish.
        monkeypatch.setenv("MX_CONTROL_TOKEN", worker)
        with pytest.raises(mx.MxError) as e:
            mx.Control(cp.url).declare("v1", TENSORS, trainer_layout="fsdp:1")
        assert e.value.code == "PermissionDenied", e.value
        control = mx.Control(cp.url, token_file=tmp_path / "orch")
        control.declare("v1", model.tensors, trainer_layout="replicated:1")
        publisher = mx.Publisher(cp.url, model=model, layout="replicated:1", slot=0, token=pub)
        publisher.set_shards(weights)
        vid = publisher.publish("v1", timeout=30.0)
        assert control.version("v1").version_id == vid and vid.startswith("mx:")
        # The publisher's token is not an orchestrator's: the roles stay apart.
        with pytest.raises(mx.MxError) as e:
            mx.Control(cp.url, token=pub).start_refit("v1", ["w-0"])
        assert e.value.code == "PermissionDenied", e.value
        publisher.close()
    with pytest.raises(mx.MxError, match="token and token_file"):
        mx.Control("http://127.0.0.1:1", token=orch, token_file=tmp_path / "orch")
    with pytest.raises(mx.MxError, match="short"):
        mx.Control("http://127.0.0.1:1", token_file=tmp_path / "short")
    # A token no control plane's table can hold (under 24 characters) is refused up front.
    with pytest.raises(mx.MxError, match="token: a token must be at least 24"):
        mx.Control("http://127.0.0.1:1", token="abc")
    with pytest.raises(mx.MxError, match="missing"):
        mx.Publisher(
            "http://127.0.0.1:1",
            model=model,
            layout="replicated:1",
            slot=0,
            token_file=tmp_path / "missing",
        )


def test_security_files_are_checked_at_start(tmp_path):
    with pytest.raises(mx.MxError, match="token file") as e:
        mx.ControlPlane(journal=tmp_path / "j.jsonl", tokens=tmp_path / "missing")
    assert "missing" in str(e.value)
    with pytest.raises(mx.MxError, match="go together"):
        mx.ControlPlane(journal=tmp_path / "j.jsonl", tls_cert=tmp_path / "cert.pem")
    # Without tokens only a loopback address is served.
    with pytest.raises(mx.MxError, match="non-loopback"):
        mx.ControlPlane(journal=tmp_path / "j.jsonl", listen="0.0.0.0:0")


def test_expected_outputs_are_computed_published_once_and_checked(control):
    """Issue 30, item 1: a trainer's greedy tokens with their top-two margins, from its own
    forward pass, published with the version; bounds checked naming the field; set once."""
    import torch

    vocab = 7

    def forward(ids):  # logits favour (last token + 1) % vocab by 2 nats, next best by 1
        t = ids.shape[1]
        logits = torch.zeros(1, t, vocab)
        for i in range(t):
            nxt = (int(ids[0, i]) + 1) % vocab
            logits[0, i, nxt] = 2.0
            logits[0, i, (nxt + 1) % vocab] = 1.0
        return logits

    out = mx.expected_outputs(forward, [[3], [5, 6]], 3, stop_tokens=[0])
    assert [p.tokens for p in out.probes] == [(4, 5, 6), (0,)]
    for p in out.probes:
        assert all(abs(m - 1.0) < 1e-5 for m in p.margins), p
        assert len(p.logprobs) == len(p.tokens) and all(lp < 0 for lp in p.logprobs)
    control.declare("v1", TENSORS, trainer_layout="fsdp:2")
    control.publish_expected_outputs("v1", out)
    control.publish_expected_outputs("v1", out)  # the same again: a no-op
    got = control.version("v1").expected_outputs  # as published, read back
    assert [(p.prompt_tokens, p.tokens) for p in got.probes] == [
        (p.prompt_tokens, p.tokens) for p in out.probes
    ]
    assert got.max_new_tokens == 3
    pairs = [
        (a, b)
        for p, q in zip(got.probes, out.probes, strict=True)
        for a, b in zip(p.margins, q.margins, strict=True)
    ]
    assert len(pairs) == 4 and all(abs(a - b) < 1e-6 for a, b in pairs), pairs
    other = mx.ExpectedOutputs((mx.Probe((3,), (1, 2, 3), (1.0, 1.0, 1.0)),), 3)
    with pytest.raises(mx.MxError, match="already published"):
        control.publish_expected_outputs("v1", other)
    bad = mx.ExpectedOutputs((mx.Probe((3,), (1, 2), (1.0,)),), 3)
    with pytest.raises(ValueError, match=r"check\.probes\[0\]\.margins: 1 values for 2 tokens"):
        control.publish_expected_outputs("v1", bad)
    with pytest.raises(mx.MxError, match="NotFound|not declared|unknown"):
        control.publish_expected_outputs("nope", out)
