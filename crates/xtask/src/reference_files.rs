//! The reference files of nix/pins.json (`reference_files`): files others
//! released — vocabularies with Hugging Face's token ids, chat templates —
//! that tests/released_files.rs holds kiln to. Each archive is fetched and
//! checked against its sha256, and only its listed members are unpacked,
//! each checked against its own sha256, into one folder of the cache.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;

use crate::cache::Cache;
use crate::fetch::fetch;
use crate::pins::Pins;
use build_support::digest::content_key;
use build_support::unpack;

/// The folder the reference files of the current pins unpack to (it may
/// not exist yet): named by what is in it.
pub fn folder(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    let archives: BTreeMap<&str, (String, BTreeMap<String, String>)> = pins
        .reference_archives()?
        .into_iter()
        .map(|(name, a)| (name, (a.download.sha256, a.members)))
        .collect();
    let key = content_key(&serde_json::json!(archives));
    Ok(cache.path("reference-files").join(&key[..16]))
}

/// Fetches and unpacks the reference files if needed; returns their folder.
pub fn provide(cache: &Cache, pins: &Pins) -> Result<PathBuf> {
    cache.publish(&folder(cache, pins)?, |staging| {
        for (name, archive) in pins.reference_archives()? {
            let path = fetch(cache, &archive.download)?;
            eprintln!(
                "unpacking {} file(s) of {name}: {}",
                archive.members.len(),
                archive.description
            );
            unpack::tar_gz_members_checked(&path, &archive.members, staging)?;
        }
        Ok(())
    })
}
