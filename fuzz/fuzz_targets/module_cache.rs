//! The module cache reader: any bytes in an entry's place are the module
//! they carry, when they are a well-formed entry for the key, or are ignored
//! and rebuilt; never a panic, and never a module the entry does not hold.
#![no_main]

use std::sync::OnceLock;

use kiln_xla::{ModuleCache, Origin};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

const REBUILT: &[u8] = b"compiled";

fuzz_target!(|data: &[u8]| {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    let cache = ModuleCache::at(dir.path());
    let key = ModuleCache::key(&["fuzz"]);
    std::fs::write(cache.path(&key), data).unwrap();
    let (module, origin) = cache
        .get_or_compile(&key, || Ok(REBUILT.to_vec()))
        .unwrap();
    match origin {
        Origin::Cached => {
            // Only a complete entry for this key, with the module's digest.
            let mut entry = b"KILNVMFB".to_vec();
            entry.extend_from_slice(key.as_bytes());
            entry.extend_from_slice(&Sha256::digest(&module));
            entry.extend_from_slice(&module);
            assert_eq!(entry, data);
        }
        Origin::Rebuilt | Origin::Compiled => assert_eq!(module, REBUILT),
    }
});
