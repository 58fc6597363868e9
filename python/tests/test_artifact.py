"""mx.Publisher.export against a real S3-compatible server (moto on loopback) and a real control
plane: a tiny llama published by two fsdp:2 slots is exported from its whole tensors as a
canonical Hugging Face checkpoint (read back byte for byte with safetensors) and, after a small
in-place update, as an exact-base XOR delta; bytes that are not the version and a base that is
not READY are refused, and every artifact is recorded with the version."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import blake3
import boto3
import pytest
import torch
from safetensors.torch import load as load_safetensors

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
# The tensors the "optimizer step" of the delta test changes (a few elements each).
STEPPED = ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight")


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


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# --- the object store ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str) -> int | None:
    """One request straight to the loopback server (no proxy); its status, None if none."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, method=method), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory):
    """A moto S3 server on a free loopback port, for this module: ``MX_MOTO_SERVER`` when set
    (scripts/test.sh: python/tests/moto_ranged.py, as for the Rust tests), else the venv's."""
    binary = Path(os.environ.get("MX_MOTO_SERVER") or Path(sys.executable).with_name("moto_server"))
    assert binary.exists(), f"{binary} is missing (scripts/setup-python.sh installs moto)"
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while _http("GET", endpoint + "/") is None:
            assert proc.poll() is None, f"moto_server exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"moto_server did not answer on {endpoint}"
            time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def s3(moto_endpoint, monkeypatch, request):
    """A fresh bucket on the moto server and the AWS_* environment pointing at it (the
    exporter reads it from this process's environment); a boto3 client to read it back."""
    bucket = "mx-" + request.node.name.replace("_", "-")[:50].lower().strip("-")
    assert _http("PUT", f"{moto_endpoint}/{bucket}") == 200
    env = {
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "mx-test",
        "AWS_SECRET_ACCESS_KEY": "mx-test-secret",
        "AWS_ALLOW_HTTP": "true",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        region_name="us-east-1",
        aws_access_key_id="mx-test",
        aws_secret_access_key="mx-test-secret",
    )

    class S3:
        name = bucket

        @staticmethod
        def url(prefix: str) -> str:
            return f"s3://{bucket}/{prefix}"

        @staticmethod
        def get(key: str) -> bytes:
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()

        @staticmethod
        def keys(prefix: str) -> list[str]:
            out = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
            return sorted(o["Key"] for o in out.get("Contents", []))

    return S3


# --- the trainer --------------------------------------------------------------------------------


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    """BF16 weights with F32 norms (mixed dtypes, as some checkpoints keep them)."""
    g = torch.Generator().manual_seed(11)
    return {
        n: torch.randn(s, generator=g).to(torch.float32 if "norm" in n else torch.bfloat16)
        for n, s in _shapes().items()
    }


@pytest.fixture
def model(weights) -> mx.Model:
    return mx.Model.from_config(CONFIG, weights)


def _rows(t: torch.Tensor, slot: int) -> tuple[int, int]:
    return t.shape[0] * slot // 2, t.shape[0] * (slot + 1) // 2


class Trainer:
    """Two fsdp:2 slots, each holding its dim-0 rows of every tensor as its own tensors and
    publishing them; rank 0 exports from the whole tensors (what ``full_tensor()`` gathers)."""

    def __init__(self, control: mx.Control, model: mx.Model, weights: dict[str, torch.Tensor]):
        self.control = control
        self.shards: list[dict[str, torch.Tensor]] = []
        self.pubs: list[mx.Publisher] = []
        for slot in range(2):
            own = {}
            for name, t in weights.items():
                lo, hi = _rows(t, slot)
                own[name] = t[lo:hi].clone()
            pub = mx.Publisher(control.url, model=model, layout="fsdp:2", slot=slot)
            self.pubs.append(pub)
            pub.set_shards(
                {n: (own[n], [_rows(t, slot)[0]] + [0] * (t.dim() - 1)) for n, t in weights.items()}
            )
            self.shards.append(own)

    def publish(self, label: str) -> str:
        """Declares ``label`` and publishes it from both slots (copy mode: the shards may be
        written at once); returns the version id once READY."""
        self.control.declare(label, self.full(), trainer_layout="fsdp:2")
        ids: list[str | BaseException | None] = [None, None]

        def run(i: int) -> None:
            try:
                ids[i] = self.pubs[i].publish(label, copy=True, timeout=60)
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
        """The whole tensors (a fresh copy: the shards concatenated)."""
        return {n: torch.cat([self.shards[0][n], self.shards[1][n]]) for n in self.shards[0]}

    def step(self) -> None:
        """A tiny in-place update of a few elements of a few tensors (what one small optimizer
        step leaves in bf16): +1e-3 on F32 elements, one ulp on BF16 ones."""
        with torch.no_grad():
            for own in self.shards:
                for name in STEPPED:
                    t = own[name].view(-1)
                    if t.dtype == torch.float32:
                        t[:4] += 1e-3
                    else:
                        t.view(torch.int16)[:4] ^= 1

    def close(self) -> None:
        for p in self.pubs:
            p.close()


@pytest.fixture
def trainer(control, model, weights):
    t = Trainer(control, model, weights)
    try:
        yield t
    finally:
        t.close()


def _refused(call, code: str, *needles: str) -> str:
    with pytest.raises(mx.MxError) as e:
        call()
    msg = str(e.value)
    assert e.value.code == code, (e.value.code, msg)
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# --- tests --------------------------------------------------------------------------------------


def test_canonical_export_is_the_published_checkpoint_byte_for_byte(trainer, control, s3, weights):
    v1 = trainer.publish("v1")
    config = json.dumps(CONFIG).encode()
    out = trainer.pubs[0].export(
        "v1", trainer.full(), to=s3.url("run/v1"), extra_files={"config.json": config}
    )
    print(f"canonical: {out['data_bytes']} bytes in {out['seconds']:.3f} s")
    assert out["kind"] == "canonical" and out["version"] == v1 and out["base"] is None
    assert out["url"] == s3.url("run/v1") and out["label"] == "v1"
    assert out["tensors"] == len(weights)
    # The data written: the safetensors files (headers included) and the index and config.
    assert out["data_bytes"] >= _nbytes(weights)

    keys = s3.keys("run/v1")
    assert "run/v1/mx-artifact.json" in keys and "run/v1/config.json" in keys
    assert s3.get("run/v1/config.json") == config
    # The manifest is the one recorded (its blake3).
    manifest_bytes = s3.get("run/v1/mx-artifact.json")
    assert blake3.blake3(manifest_bytes).hexdigest() == out["manifest_digest"]

    # Hugging Face layout: the index maps every tensor to a file that holds it, byte-exact.
    index = json.loads(s3.get("run/v1/model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == _nbytes(weights)
    files = sorted(set(index["weight_map"].values()))
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded |= load_safetensors(s3.get(f"run/v1/{f}"))
    assert set(loaded) == set(weights)
    for name, t in weights.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert _raw(loaded[name]) == _raw(t), name

    # The control plane records the artifact with the version.
    info = control.version("v1")
    assert info.raw["artifacts"] == [
        {
            "url": s3.url("run/v1"),
            "manifest_digest": out["manifest_digest"],
            "kind": "canonical",
            "base": None,
        }
    ]


def test_delta_against_the_previous_version_is_small_and_exact(trainer, control, s3, weights):
    v1 = trainer.publish("v1")
    w1 = trainer.full()
    full = trainer.pubs[0].export("v1", w1, to=s3.url("run/v1"))
    trainer.step()
    v2 = trainer.publish("v2")
    w2 = trainer.full()
    assert v2 != v1
    for name in STEPPED:
        assert _raw(w2[name]) != _raw(w1[name]), name

    out = trainer.pubs[0].export("v2", w2, to=s3.url("run/v2"), base=("v1", w1), chunk_bytes=4096)
    model_bytes = _nbytes(weights)
    print(
        f"model {model_bytes} bytes; canonical {full['data_bytes']} bytes in "
        f"{full['seconds']:.3f} s; delta {out['data_bytes']} bytes in {out['seconds']:.3f} s"
    )
    assert out["kind"] == "delta" and out["version"] == v2 and out["base"] == v1
    assert out["base_url"] == s3.url("run/v1")
    assert 0 < out["data_bytes"] < model_bytes // 50, (out["data_bytes"], model_bytes)

    # The manifest: the target's tensor digests, and ranges stored only where bytes changed.
    manifest_bytes = s3.get("run/v2/mx-artifact.json")
    assert blake3.blake3(manifest_bytes).hexdigest() == out["manifest_digest"]
    m = json.loads(manifest_bytes)
    assert m["kind"] == "delta" and m["chunk_bytes"] == 4096
    for entry, chunks in zip(m["tensors"], m["chunks"], strict=True):
        name = entry["name"]
        assert entry["digest"] == blake3.blake3(_raw(w2[name])).hexdigest(), name
        a, b = _raw(w1[name]), _raw(w2[name])
        changed = [a[i : i + 4096] != b[i : i + 4096] for i in range(0, len(a), 4096)]
        assert [c is not None for c in chunks] == changed, name
        assert any(changed) == (name in STEPPED), name
        assert sum(changed) <= 2, name  # each slot stepped the first elements of its rows

    # Recorded with its lineage; v1 keeps its own canonical artifact.
    assert control.version("v2").raw["artifacts"] == [
        {
            "url": s3.url("run/v2"),
            "manifest_digest": out["manifest_digest"],
            "kind": "delta",
            "base": v1,
        }
    ]
    assert [a["kind"] for a in control.version("v1").raw["artifacts"]] == ["canonical"]


def test_bytes_that_are_not_the_version_are_refused_naming_the_tensor(trainer, control, s3):
    trainer.publish("v1")
    whole = trainer.full()
    with torch.no_grad():
        whole["model.layers.1.mlp.up_proj.weight"][3, 5] += 1  # written after publish
    _refused(
        lambda: trainer.pubs[0].export("v1", whole, to=s3.url("run/v1")),
        "InvalidArgument",
        "model.layers.1.mlp.up_proj.weight",
    )
    # Proven before anything is written, and nothing recorded.
    assert s3.keys("run/v1") == []
    assert control.version("v1").raw["artifacts"] == []

    # A delta whose base bytes are not the base version is refused the same way: checked
    # against the base's own shards whether or not the base has an artifact yet.
    w1 = trainer.full()
    trainer.step()
    trainer.publish("v2")
    for exported_base in (False, True):
        if exported_base:
            trainer.pubs[0].export("v1", w1, to=s3.url("run/v1"))
        _refused(
            lambda: trainer.pubs[0].export(
                "v2", trainer.full(), to=s3.url("run/v2"), base=("v1", whole)
            ),
            "InvalidArgument",
            "model.layers.1.mlp.up_proj.weight",
        )
        assert s3.keys("run/v2") == []
        assert control.version("v2").raw["artifacts"] == []


def test_a_delta_against_a_version_that_is_not_ready_is_refused(trainer, control, s3, weights):
    control.declare("v0", weights, trainer_layout="fsdp:2")  # declared, never published
    trainer.publish("v1")
    whole = trainer.full()
    _refused(
        lambda: trainer.pubs[0].export("v1", whole, to=s3.url("run/v1"), base=("v0", weights)),
        "FailedPrecondition",
        "v0",
        "not READY",
    )
    _refused(
        lambda: trainer.pubs[0].export("v1", whole, to=s3.url("run/v1"), base=("v9", weights)),
        "NotFound",
        "v9",
    )
    # Nor is the version itself exportable before it is READY.
    control.declare("v2", weights, trainer_layout="fsdp:2")
    _refused(
        lambda: trainer.pubs[0].export("v2", whole, to=s3.url("run/v2")),
        "FailedPrecondition",
        "v2",
        "not READY",
    )
    assert s3.keys("run/v1") == [] and s3.keys("run/v2") == []
    assert control.version("v1").raw["artifacts"] == []


def test_bad_arguments_are_value_errors_naming_the_tensor(trainer, s3, weights):
    pub = trainer.pubs[0]
    norm = "model.norm.weight"
    url = s3.url("run/v1")

    def refused(tensors, *needles, **kw):
        with pytest.raises(ValueError) as e:
            pub.export("v1", tensors, to=kw.pop("to", url), **kw)
        for n in needles:
            assert n in str(e.value), (n, str(e.value))

    q = "model.layers.0.self_attn.q_proj.weight"
    refused(weights | {q: weights[q].t()}, q, "not contiguous")
    refused(weights | {q: weights[q][:10]}, q, "whole")
    refused(weights | {norm: weights[norm].double()}, norm, "F64")
    refused(weights | {norm: weights[norm].numpy()}, norm, "torch.Tensor")
    refused(weights | {"model.extra.weight": weights[norm]}, "model.extra.weight", "no such")
    refused(weights, "s3://", to="/tmp/not-s3")
    refused(weights, "config.json", extra_files={"../config.json": b"{}"})
    refused(weights, "canonical", base=("v0", weights), extra_files={"config.json": b"{}"})
    refused(weights, "chunk_bytes", chunk_bytes=0)

    # The extension itself: a bad dtype or a length that is not the tensor's, named.
    t = weights[norm]
    row = (norm, "F32", [H], t.data_ptr(), t.numel() * 4, t)
    for bad, needle in (
        ((norm, "F33", [H], *row[3:]), "F33"),
        ((*row[:4], t.numel() * 4 - 1, t), "bytes"),
        ((*row[:3], 0, t.numel() * 4, t), "address"),
    ):
        with pytest.raises(ValueError) as e:
            pub._inner.export("v1", [bad], url)
        assert norm in str(e.value) and needle in str(e.value), str(e.value)
