//! `mx-lab`: the harness's binary: every `mx` command, plus the demo, the fault matrix (with the
//! fault injection only this binary arms) and the benchmarks (`mx_harness::lab`).

#[path = "../provenance.rs"]
mod provenance;

/// The same allocator as `mx`, so that what the benchmarks measure is what users run.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    mx_harness::lab::main(provenance::BUILD, provenance::LONG_VERSION)
}
