"""How small is one RL step as an XOR delta? Real AdamW steps on SmolLM2, exported through mx.

A realistic trainer keeps fp32 master weights and casts them into the bf16 weights it serves
after every optimizer step. This script does exactly that with the checkpoint (transformers'
``LlamaForCausalLM`` in fp32, next-token cross entropy on a fixed random batch, AdamW), publishes
the served bf16 weights as versions through ``mx.Publisher`` to an embedded control plane, exports
the first as a canonical artifact and each stepped one as an exact-base XOR delta against it
(``Publisher.export``) into a real S3-compatible server (moto, started on loopback), and reports
the bytes written: ``delta_vs_full: [{lr, step, delta_bytes, full_bytes, changed_fraction}]``.

Run (from the repository root)::

    .mx/venv/bin/python examples/delta_vs_full.py --report /tmp/delta.json

Options: ``--model DIR`` (default ``.mx/models/smollm2-135m``), ``--lrs 1e-6,1e-5``, ``--steps N``
optimizer steps per learning rate (default 2; each step's delta is against the step before it),
``--chunk-bytes`` (default 4 MiB). Every learning rate starts from the checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from procs import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=2).read()
            return proc, url
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto_server did not answer on {url}") from None
            time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=".mx/models/smollm2-135m")
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--report")
    args = ap.parse_args()
    model_dir = os.path.join(REPO, args.model) if not os.path.isabs(args.model) else args.model

    import torch
    from transformers import AutoModelForCausalLM

    import mx

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    moto, endpoint = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_REGION="us-east-1",
        AWS_ACCESS_KEY_ID="mx-bench",
        AWS_SECRET_ACCESS_KEY="mx-bench",
        AWS_ALLOW_HTTP="true",
    )
    req = urllib.request.Request(endpoint + "/mx-bench", method="PUT")
    urllib.request.urlopen(req, timeout=10).read()
    tmp = tempfile.mkdtemp(prefix="mx-delta-")
    rows = []
    try:
        with mx.ControlPlane(os.path.join(tmp, "journal.jsonl")) as cp:
            control = mx.Control(cp.url)
            model = mx.Model.from_dir(model_dir)
            names = sorted(t.name for t in model.tensors)
            master0 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            state0 = master0.state_dict()
            # The bf16 weights the trainer serves (registered once, rewritten after each step).
            served = {n: state0[n].detach().to(torch.bfloat16).contiguous() for n in names}
            full_bytes = sum(t.numel() * t.element_size() for t in served.values())
            pub = mx.Publisher(cp.url, model=model, layout="fsdp:1", slot=0)
            pub.set_shards({n: (t, [0] * t.dim()) for n, t in served.items()})
            g = torch.Generator().manual_seed(20261202)
            batch = torch.randint(0, master0.config.vocab_size, (2, 65), generator=g)

            def publish(label: str, base: tuple[str, dict] | None) -> dict:
                control.declare(label, served, trainer_layout="fsdp:1")
                pub.publish(label, copy=True)
                out = pub.export(
                    label,
                    served,
                    to=f"s3://mx-bench/run/{label}",
                    base=base,
                    chunk_bytes=args.chunk_bytes,
                )
                pub.release(label)
                return out

            full = publish("v0", None)
            print(f"canonical v0: {full['data_bytes']} bytes ({full_bytes} of tensors)")
            for lr in [float(x) for x in args.lrs.split(",")]:
                master = copy.deepcopy(master0)
                opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
                prev_label = "v0"
                prev = {n: t.clone() for n, t in served.items()}
                state = master.state_dict()
                for step in range(1, args.steps + 1):
                    opt.zero_grad()
                    out = master(input_ids=batch, labels=batch)
                    out.loss.backward()
                    opt.step()
                    with torch.no_grad():
                        for n in names:
                            served[n].copy_(state[n].to(torch.bfloat16))
                    changed = sum(
                        int((served[n].view(torch.int16) != prev[n].view(torch.int16)).sum())
                        for n in names
                    )
                    label = f"lr{lr:g}-step{step}"
                    t0 = time.perf_counter()
                    d = publish(label, (prev_label, prev))
                    row = {
                        "lr": lr,
                        "step": step,
                        "delta_bytes": d["data_bytes"],
                        "full_bytes": full["data_bytes"],
                        "delta_over_full": d["data_bytes"] / full["data_bytes"],
                        "changed_fraction": changed / sum(t.numel() for t in served.values()),
                        "loss": float(out.loss.detach()),
                        "export_s": time.perf_counter() - t0,
                    }
                    rows.append(row)
                    print(json.dumps(row))
                    prev_label, prev = label, {n: t.clone() for n, t in served.items()}
                # The next learning rate starts from the checkpoint again.
                with torch.no_grad():
                    for n in names:
                        served[n].copy_(state0[n].to(torch.bfloat16))
            pub.close()
    finally:
        moto.kill()
        moto.wait()
    report = {"model": args.model, "chunk_bytes": args.chunk_bytes, "delta_vs_full": rows}
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
