//! `kiln pull` and `kiln list`: pinned models fetched into the cache.
//!
//! A pull streams the pinned archive to a temporary file beside the cache
//! entry, hashing as it goes, checks the sha256, extracts the one member to
//! a second temporary file and renames that into place. Until the rename
//! there is no `<name>.gguf`; an interrupted or failed pull leaves at most a
//! temporary file, never one that `--model` would pick up, and the next pull
//! removes it. A stamp beside the model (`<name>.gguf.sha256`) records the
//! sha256, size and modification time it had when hashed: every use checks
//! the file against it and hashes the file again when it changed, so a
//! damaged model is refused, and `kiln pull` replaces it.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, Write};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kiln_core::pinned::{self, PinnedModel, Pulled, Rehash};
use sha2::{Digest, Sha256};

/// Pulls `id` unless an intact copy is there (checked cheaply by its stamp,
/// or hashed again with `verify`); a damaged copy is replaced. Pulls take
/// turns on a lock in the models folder, so the temporary files found there
/// under it are the leftovers of interrupted pulls, and are removed.
pub fn pull(id: &str, verify: bool) -> Result<()> {
    let Some(model) = pinned::find(id) else {
        bail!("no pinned model is called {id:?}; `kiln list` shows them");
    };
    let dest = model.path()?;
    let dir = dest.parent().expect("models/<name>.gguf has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let lock = open_lock(&dir.join(".pull.lock"))?;
    lock.lock()
        .with_context(|| format!("cannot lock {}", dir.join(".pull.lock").display()))?;
    remove_leftovers(dir)?;
    let rehash = if verify {
        Rehash::Always
    } else {
        Rehash::IfChanged
    };
    match model.check(rehash)? {
        Pulled::Intact if verify => {
            println!(
                "{id} is already pulled and intact (its sha256 matches the pin): {}",
                dest.display()
            );
            return Ok(());
        }
        Pulled::Intact => {
            println!(
                "{id} is already pulled: {} (its size and modification time are those it had \
                 when its sha256 was checked; `kiln pull --verify {id}` hashes it again)",
                dest.display()
            );
            return Ok(());
        }
        Pulled::Damaged(why) => {
            eprintln!(
                "kiln pull: {} is damaged ({why}); pulling it again",
                dest.display()
            );
        }
        Pulled::Missing => {}
    }
    let mut archive = tempfile::Builder::new()
        .prefix(DOWNLOAD_PREFIX)
        .tempfile_in(dir)
        .with_context(|| format!("cannot write in {}", dir.display()))?;
    download(&model, archive.as_file_mut())?;
    let mut gguf = tempfile::Builder::new()
        .prefix(EXTRACT_PREFIX)
        .tempfile_in(dir)
        .with_context(|| format!("cannot write in {}", dir.display()))?;
    extract(&model, archive.as_file_mut(), gguf.as_file_mut())?;
    gguf.as_file().sync_all()?;
    gguf.persist(&dest)
        .with_context(|| format!("cannot move the model to {}", dest.display()))?;
    // The stamp that lets later uses skip hashing it.
    if model.check(Rehash::Always)? != Pulled::Intact {
        bail!("{} changed while it was being pulled", dest.display());
    }
    println!("pulled {id}: {}", dest.display());
    Ok(())
}

/// The pulls' lock file, opened without following a link and without
/// truncating: a link planted in a shared cache must not make kiln write
/// through it.
fn open_lock(path: &std::path::Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|error| match error.raw_os_error() {
            Some(libc::ELOOP) => anyhow::anyhow!(
                "{} is a symbolic link; kiln does not follow links in its cache: remove it and pull again",
                path.display()
            ),
            _ => anyhow::Error::new(error).context(format!("cannot write {}", path.display())),
        })
}

const DOWNLOAD_PREFIX: &str = ".download-";
const EXTRACT_PREFIX: &str = ".extract-";

/// Removes what interrupted pulls left (SIGINT, SIGTERM, SIGKILL, power).
fn remove_leftovers(dir: &std::path::Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(DOWNLOAD_PREFIX) || name.starts_with(EXTRACT_PREFIX) {
            std::fs::remove_file(entry.path()).with_context(|| {
                format!(
                    "cannot remove an interrupted pull's {}",
                    entry.path().display()
                )
            })?;
        }
    }
    Ok(())
}

/// Streams the archive into `out`, checking its sha256.
fn download(model: &PinnedModel, out: &mut File) -> Result<()> {
    // The system trust store, so that pulls work behind TLS-inspecting
    // proxies too (as xtask's downloads do).
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into();
    let response = agent
        .get(&model.url)
        .call()
        .with_context(|| format!("cannot download {}", model.url))?;
    let length = response.body().content_length();
    let bar = ProgressBar::new(length.unwrap_or(0)).with_style(
        ProgressStyle::with_template(
            "{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .context("progress template")?,
    );
    bar.set_message(format!("pulling {}", model.id));
    let mut reader = response.into_body().into_reader();
    let mut hasher = Sha256::new();
    let mut writer = BufWriter::new(out);
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let n = reader
            .read(&mut buffer)
            .with_context(|| format!("download of {} broke off", model.url))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        writer
            .write_all(&buffer[..n])
            .context("cannot write the download")?;
        bar.inc(n as u64);
    }
    writer.flush().context("cannot write the download")?;
    bar.finish_and_clear();
    let actual = hex::encode(hasher.finalize());
    if actual != model.sha256 {
        bail!(
            "{} has sha256 {actual}, but nix/pins.json pins {}; the download was discarded \
             (a changed upstream file needs a reviewed pin update)",
            model.url,
            model.sha256
        );
    }
    Ok(())
}

/// Copies the pinned member of the verified archive into `out`.
fn extract(model: &PinnedModel, archive: &mut File, out: &mut File) -> Result<()> {
    archive.rewind()?;
    let mut zip = zip::ZipArchive::new(&mut *archive)
        .with_context(|| format!("{} is not a zip archive", model.name))?;
    let mut member = zip
        .by_name(&model.member)
        .with_context(|| format!("{} has no member {}", model.name, model.member))?;
    if member.size() != model.member_size {
        bail!(
            "{} in {} is {} bytes, the pin says {}",
            model.member,
            model.name,
            member.size(),
            model.member_size
        );
    }
    let mut hasher = Sha256::new();
    let mut writer = BufWriter::new(out);
    let mut buffer = vec![0u8; 1 << 16];
    let mut copied = 0u64;
    loop {
        let n = member
            .read(&mut buffer)
            .with_context(|| format!("cannot extract {}", model.member))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        writer
            .write_all(&buffer[..n])
            .context("cannot write the model")?;
        copied += n as u64;
    }
    writer.flush().context("cannot write the model")?;
    let actual = hex::encode(hasher.finalize());
    if copied != model.member_size || actual != model.member_sha256 {
        bail!(
            "{} extracted as {copied} bytes with sha256 {actual}; the pin says {} bytes, {}",
            model.member,
            model.member_size,
            model.member_sha256
        );
    }
    Ok(())
}

/// Prints each pinned model and whether it is pulled (and intact).
pub fn list() -> Result<()> {
    for model in pinned::models() {
        let path = model.path()?;
        let state = match model.check(Rehash::IfChanged)? {
            Pulled::Intact => format!("pulled: {}", path.display()),
            Pulled::Damaged(why) => format!(
                "DAMAGED ({why}): {}; `kiln pull {}` replaces it",
                path.display(),
                model.id
            ),
            Pulled::Missing => format!("not pulled (kiln pull {})", model.id),
        };
        println!("{:<24} {}\n{:<24} {state}", model.id, model.description, "");
    }
    Ok(())
}
