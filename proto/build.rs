//! Compiles `proto/` with protox (no system protoc) and keeps the encoded file descriptor set
//! for gRPC server reflection.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/gradsync/ps/v1/ps.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("gradsync_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().bytes(".gradsync.ps.v1").compile_fds(fds)?;
    Ok(())
}
