//! Generates the gRPC code for `proto/mx/v1/control.proto` (tonic 0.14 + prost).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../../proto/mx/v1/control.proto";
    println!("cargo:rerun-if-changed={proto}");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .btree_map(".")
        .compile_protos(&[proto], &["../../proto"])?;
    Ok(())
}
