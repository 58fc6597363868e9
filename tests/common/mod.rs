//! Helpers shared by the cross-crate tests.
#![allow(dead_code)] // each test binary uses a subset

use std::path::PathBuf;

/// The repository root.
pub(crate) fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The model dir, or None (with a message) when setup has not run and NIXL is not required.
pub(crate) fn model(name: &str) -> Option<PathBuf> {
    let dir = repo().join(".mx/models").join(name);
    if dir.join("config.json").exists() && mx_nixl::nixl_available().is_ok() {
        return Some(dir);
    }
    if std::env::var("MX_REQUIRE_NIXL").as_deref() == Ok("1") {
        panic!(
            "{} or NIXL missing and MX_REQUIRE_NIXL=1: run scripts/setup.sh",
            dir.display()
        );
    }
    eprintln!(
        "skipping: {} or NIXL missing (run scripts/setup.sh)",
        dir.display()
    );
    None
}

/// A rank's live bytes built element by element from whole tensors (`specs[i]`'s row-major
/// bytes are `bytes[i]`), none of the planner's code involved.
pub(crate) fn reference_rank(
    rl: &mx_layout::RankLayout,
    specs: &[mx_layout::TensorSpec],
    bytes: &[Vec<u8>],
) -> Vec<u8> {
    let mut buf = vec![0u8; rl.total_bytes as usize];
    for p in &rl.params {
        for piece in &p.pieces {
            let i = specs.iter().position(|s| s.name == piece.tensor).unwrap();
            let s = slice(&bytes[i], &specs[i], &piece.region);
            buf[piece.offset as usize..piece.offset as usize + s.len()].copy_from_slice(&s);
        }
    }
    buf
}

/// `region`'s bytes of a whole tensor, row-major.
pub(crate) fn slice(
    full: &[u8],
    spec: &mx_layout::TensorSpec,
    region: &mx_layout::TensorBox,
) -> Vec<u8> {
    let es = spec.dtype.size_bytes() as usize;
    let (run, starts) =
        mx_layout::plan::decompose(region, &mx_layout::TensorBox::full(&spec.shape));
    let mut out = Vec::new();
    for s in starts {
        out.extend_from_slice(&full[s as usize * es..(s + run) as usize * es]);
    }
    out
}

/// The demo's version `step` of a checkpoint: its tensors (name, dtype, shape) and bytes after
/// the deterministic training steps 2..=step.
pub(crate) fn demo_version(
    dir: &std::path::Path,
    step: u32,
) -> (Vec<mx_layout::TensorSpec>, Vec<Vec<u8>>) {
    let ck = mx_checkpoint::Checkpoint::open(dir).unwrap();
    let specs = ck.specs();
    let bytes = specs
        .iter()
        .map(|s| {
            let mut b = ck.tensor(&s.name).unwrap().data.to_vec();
            for k in 2..=step {
                mx_layout::update::training_step(s.dtype, &mut b, k);
            }
            b
        })
        .collect();
    (specs, bytes)
}

/// A two-worker tokio runtime for tests that call async clients from sync code.
pub(crate) fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Child processes, killed (SIGKILL) and reaped when dropped, so a failing test leaves none
/// behind.
pub(crate) struct Kids(pub(crate) Vec<std::process::Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A loopback TCP port free at the time of the call.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The binary that runs `mx ARGS`: the product's `mx`, or `mx-lab` for the harness's commands
/// (the demo trainer `publish`, `demo`, `validate`, `bench`) and for anything `--failpoints`.
pub(crate) fn exe(args: &[&str]) -> &'static str {
    let lab = matches!(
        args.first().copied(),
        Some("publish" | "demo" | "validate" | "bench")
    ) || args.contains(&"--failpoints");
    if lab {
        env!("CARGO_BIN_EXE_mx-lab")
    } else {
        env!("CARGO_BIN_EXE_mx")
    }
}
