//! Generates the gRPC code from proto/transfer.proto with a vendored protoc, so a build
//! needs no system protobuf compiler.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build finds protoc through PROTOC.
    unsafe_env_set("PROTOC", protoc);
    let well_known = protoc_bin_vendored::include_path()?;
    tonic_prost_build::configure()
        .bytes(".mover.transfer.v1")
        .compile_protos(
            &[
                "proto/transfer.proto",
                "proto/replication.proto",
                "proto/hydrate.proto",
                "proto/schedule.proto",
                "proto/locate.proto",
                "proto/snapshot_metadata.proto",
                "proto/csi.proto",
            ],
            // csi.proto imports google/protobuf/*: protoc's own well-known types.
            &[
                "proto",
                well_known
                    .to_str()
                    .ok_or("protoc's include path is not UTF-8")?,
            ],
        )?;
    Ok(())
}

#[allow(unsafe_code)]
fn unsafe_env_set(key: &str, value: std::path::PathBuf) {
    // SAFETY: called once at the start of a single-threaded build script, before any
    // other thread exists, so no concurrent reader of the environment can race it.
    unsafe { std::env::set_var(key, value) };
}
