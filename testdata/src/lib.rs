//! Where the repository's vendored test data lives, for the tests of every
//! crate: one place that knows the layout of `testdata/`.

use std::path::PathBuf;

/// The folder of this crate, which holds the data beside its sources.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `testdata/vllm-golden/frames`: messages captured from vLLM's own publisher.
pub fn vllm_golden_frames() -> PathBuf {
    root().join("vllm-golden").join("frames")
}

/// The bytes of one golden frame file, e.g. `int_00_stored_4blocks_root.payload.msgpack`.
/// A missing file is an error naming the path, so a test fails with a clear message.
pub fn golden_frame(name: &str) -> std::io::Result<Vec<u8>> {
    let path = vllm_golden_frames().join(name);
    std::fs::read(&path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    #[test]
    fn golden_frames_are_present() {
        let frame = super::golden_frame("int_00_stored_4blocks_root.payload.msgpack");
        assert!(frame.is_ok_and(|bytes| !bytes.is_empty()));
        assert!(super::root()
            .join("vllm-golden/vectors/block_hashes_default_seed.json")
            .is_file());
    }
}
