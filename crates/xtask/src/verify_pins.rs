//! `cargo xtask verify-pins`: every pinned input, for every system, fetched
//! and checked against its sha256.

use anyhow::Result;

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::{Download, Pins};

/// Downloads every pinned input for every system and checks its hash.
pub fn run(cache: &Cache, pins: &Pins) -> Result<()> {
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
