//! Downloads, each checked against its pinned sha256 before anything uses it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use indicatif::{ProgressBar, ProgressStyle};

use crate::cache::Cache;
use crate::digest::{Digest, Sha256, sha256_file};
use crate::pins::Download;

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

/// Downloads `url` into a temporary file in `dir` whose content the caller
/// must verify before use (for inputs pinned by the hash of what they unpack
/// to, as flake.lock's NAR hashes).
pub fn download_unverified(url: &str, dir: &Path) -> Result<tempfile::NamedTempFile> {
    std::fs::create_dir_all(dir)?;
    Ok(stream_to_temp(url, url, dir)?.0)
}

/// Streams `url` into a temporary file in `dir`; returns it and its sha256.
fn stream_to_temp(url: &str, label: &str, dir: &Path) -> Result<(tempfile::NamedTempFile, String)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into();
    let response = agent
        .get(url)
        .call()
        .with_context(|| format!("cannot download {label} from {url}"))?;
    let length = response
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let bar = match length {
        Some(len) => ProgressBar::new(len).with_style(
            ProgressStyle::with_template(
                "{msg:40!} {bar:30} {bytes:>10}/{total_bytes:10} {bytes_per_sec:>12}",
            )
            .expect("valid template"),
        ),
        None => ProgressBar::new_spinner(),
    };
    bar.set_message(label.to_string());
    let mut reader = response.into_body().into_reader();
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader
            .read(&mut buf)
            .with_context(|| format!("download of {url} broke off"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        tmp.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok((tmp, crate::digest::hex(hasher)))
}
