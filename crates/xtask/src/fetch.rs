//! Downloads, each checked against its pinned sha256 before anything uses
//! it; and `cargo xtask verify-pins`, every pinned input fetched so.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use build_support::digest::sha256_file;
use build_support::download::stream_to_temp;

use crate::cache::Cache;
use crate::pins::{Download, Pins};

/// Returns the local path of a pinned download, fetching it if needed. A file
/// already in the cache is hashed again before it is handed out.
pub fn fetch(cache: &Cache, pin: &Download) -> Result<PathBuf> {
    let dir = cache.path("downloads").join(&pin.sha256);
    let dest = dir.join(&pin.name);
    if dest.exists() {
        let actual = sha256_file(&dest)?;
        if actual == pin.sha256 {
            return Ok(dest);
        }
        eprintln!(
            "cached {} has sha256 {actual}, not the pinned {}; fetching it again",
            dest.display(),
            pin.sha256
        );
        std::fs::remove_file(&dest)?;
    }
    std::fs::create_dir_all(&dir)?;
    download_verified(pin, &dir, &dest)?;
    Ok(dest)
}

/// Streams `pin.url` into a temporary file beside `dest`, hashing as it goes;
/// only a file with the pinned hash is renamed to `dest`.
fn download_verified(pin: &Download, dir: &Path, dest: &Path) -> Result<()> {
    let (tmp, actual) = stream_to_temp(&pin.url, &pin.name, dir)?;
    if actual != pin.sha256 {
        return Err(anyhow!(
            "sha256 mismatch for {}\n  url:      {}\n  pinned:   {}\n  received: {actual}\n\
             The file was not used and nothing was kept. If the upstream file really changed, \
             review it and update the pin in nix/pins.json.",
            pin.name,
            pin.url,
            pin.sha256
        ));
    }
    tmp.persist(dest)
        .with_context(|| format!("cannot store {}", dest.display()))?;
    eprintln!("fetched {} (sha256 verified)", pin.name);
    Ok(())
}

/// Downloads every pinned input for every system and checks its hash.
pub fn verify_pins(cache: &Cache, pins: &Pins) -> Result<()> {
    let mut all: Vec<&Download> = vec![&pins.iree.source.download];
    all.extend(pins.iree.compiler.wheels.values());
    for wheel in pins.cuda.wheels.values() {
        all.extend(wheel.systems.values());
    }
    all.extend(pins.tools.cmake.systems.values());
    all.extend(pins.tools.ninja.systems.values());
    let archives = pins.reference_archives()?;
    all.extend(archives.iter().map(|(_, archive)| &archive.download));
    for pin in &all {
        fetch(cache, pin)?;
        println!("ok  {}  {}", pin.sha256, pin.name);
    }
    println!("{} pinned inputs verified", all.len());
    Ok(())
}
