//! A download streamed to a temporary file, hashed as it comes, with a
//! progress bar; whether its sha256 is the expected one is the caller's to
//! judge.

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::digest::{Digest, Sha256};

/// Streams `url` into a temporary file in `dir`; returns it and its sha256.
/// `label` names the download on the progress bar and in errors.
pub fn stream_to_temp(
    url: &str,
    label: &str,
    dir: &Path,
) -> Result<(tempfile::NamedTempFile, String)> {
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
