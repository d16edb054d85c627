//! Compiles Cubelet's CRI v1 definitions (`proto/cri/v1/api.proto`, package
//! `runtime.v1`) into prost messages and tonic servers and clients.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = proto_root.join("cri/v1/api.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Registry secrets: Debug is written by hand in lib.rs, redacted.
        .skip_debug([".runtime.v1.AuthConfig"])
        .compile_protos(&[file], &[proto_root])?;
    Ok(())
}
