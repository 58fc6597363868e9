//! `mx`: live policy-weight refit for RL. The binary is thin: the commands live in `mx-cli`
//! (see README.md for the architecture); this file only stamps the build and picks the
//! allocator. It carries no test machinery: the demo, the fault matrix and the benchmarks are
//! `mx-lab` (src/bin/mx-lab.rs).

mod provenance;

/// mimalloc instead of glibc's malloc: the control plane allocates per engine call, per
/// journal record and per gRPC message, and at 10,000 workers glibc's malloc (arena locks,
/// consolidation) took ~40% of its CPU (`mx-lab bench control`, perf).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    mx_cli::main(provenance::BUILD, provenance::LONG_VERSION)
}
