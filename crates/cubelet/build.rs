//! Compiles Cubelet's admin API (`proto/cubelet/admin/v1/admin.proto`) into
//! tonic server and client code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = proto_root.join("cubelet/admin/v1/admin.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&[file], &[proto_root])?;
    Ok(())
}
