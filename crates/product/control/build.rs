//! Generates the gRPC code for `proto/mx/v1/control.proto` (tonic 0.14 + prost).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../../../proto/mx/v1/control.proto";
    println!("cargo:rerun-if-changed={proto}");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("control_descriptor.bin"))
        .build_server(true)
        .build_client(true)
        .btree_map(".")
        .compile_protos(&[proto], &["../../../proto"])?;
    Ok(())
}
