//! Reading untrusted input files: regular files only (a FIFO, a device such
//! as `/dev/zero` or a folder is an error, never a hang or an endless read),
//! through a size limit checked before anything is read.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// Opens `path` (symlinks followed) if it is a regular file; returns it and
/// its size. Opening does not block, even on a FIFO.
pub fn open_regular(path: &Path) -> Result<(File, u64)> {
    let io = |error| Error::Io {
        path: path.to_path_buf(),
        error,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let metadata = file.metadata().map_err(io)?;
    let kind = metadata.file_type();
    if !kind.is_file() {
        let kind = if kind.is_dir() {
            "a folder"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(Error::NotAFile {
            path: path.to_path_buf(),
            kind,
        });
    }
    Ok((file, metadata.len()))
}

/// The bytes of the regular file `path`, which must hold at most `limit`
/// bytes (`what` names the file in the error).
pub fn read_limited(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>> {
    let (file, size) = open_regular(path)?;
    let too_large = |size| Error::TooLarge {
        path: path.to_path_buf(),
        size,
        limit,
        what,
    };
    if size > limit {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    // The file may grow after the size check: read at most one byte past it.
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| Error::Io {
            path: path.to_path_buf(),
            error,
        })?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The UTF-8 text of [`read_limited`].
pub fn read_text_limited(path: &Path, limit: u64, what: &'static str) -> Result<String> {
    String::from_utf8(read_limited(path, limit, what)?).map_err(|_| Error::Io {
        path: path.to_path_buf(),
        error: std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_limited(&file, 10, "a test").unwrap(), b"0123456789");
        let error = read_limited(&file, 9, "a test").unwrap_err().to_string();
        assert!(error.contains("10 bytes") && error.contains("9"), "{error}");

        // /dev/zero never ends; a FIFO with no writer would block forever.
        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let error = read_limited(&zero, 1 << 20, "a test")
            .unwrap_err()
            .to_string();
        assert!(error.contains("a device"), "{error}");
        let fifo = dir.path().join("fifo");
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let error = read_limited(&fifo, 1 << 20, "a test")
            .unwrap_err()
            .to_string();
        assert!(error.contains("a FIFO"), "{error}");
        let error = read_limited(dir.path(), 1 << 20, "a test")
            .unwrap_err()
            .to_string();
        assert!(error.contains("a folder"), "{error}");
    }
}
