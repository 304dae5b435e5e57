//! # stormguard-input
//!
//! Reading the files a person hands stormguard — proxy configs and their certificates, audited
//! mesh configs, simulator scenarios, chaos scripts, recorded traces — with bounds, so that a
//! wrong path is a clear error and never a hang or an exhausted machine.
//!
//! `std::fs::read_to_string` on `/dev/zero` reads until memory runs out; on a FIFO with no
//! writer it blocks forever, in `open`; on a 10 GiB file it allocates 10 GiB. Every tool that
//! reads a config-sized file goes through [`read`] or [`read_to_string`] instead:
//!
//! - **only a regular file** (after following symlinks) is read: a directory, a FIFO, a socket
//!   or a device is refused before it is opened, naming what it is (`is a FIFO, not a regular
//!   file`). On Unix the file is opened non-blocking and checked again, so a path swapped for a
//!   FIFO in between cannot block either;
//! - **at most `limit` bytes** ([`MAX_FILE`], 16 MiB, for every config-sized file): a larger
//!   file is refused (`is larger than 16 MiB`), including one that grows while it is read.
//!
//! A recorded trace is a stream, not a config: it may be large and may come through a pipe
//! (`stormguard replay --policy SPEC <(zcat incident.jsonl.gz)`). [`open_stream`] accepts a
//! regular file or a FIFO (and refuses directories and devices), and [`read_line`] bounds each
//! line ([`MAX_LINE`], 1 MiB) instead of the whole.
//!
//! Errors are `std::io::Error`s whose message says what is wrong with the path (the caller
//! prefixes the path, as it does for any read error): `ErrorKind::IsADirectory`,
//! `InvalidInput` (not a regular file), `FileTooLarge`, `InvalidData` (not UTF-8, a line too
//! long).
//!
//! ```
//! let dir = std::env::temp_dir();
//! let err = stormguard_input::read_to_string(&dir, stormguard_input::MAX_FILE).unwrap_err();
//! assert_eq!(err.to_string(), "is a directory, not a file");
//! # #[cfg(unix)]
//! # {
//! let err = stormguard_input::read(std::path::Path::new("/dev/zero"), 1024).unwrap_err();
//! assert_eq!(err.to_string(), "is a character device, not a regular file");
//! # }
//! ```
//!
//! This is the one place outside the proxy's sockets where stormguard reads input it did not
//! make; it is its own crate because `stormguard-core` does no I/O and every reader (audit,
//! proxy, sim, chaos, the CLI) needs it.

#![warn(missing_docs)]

use std::fs::{File, Metadata};
use std::io::{self, BufRead, ErrorKind, Read};
use std::path::Path;

/// The most a config-sized file may hold: 16 MiB (a proxy config, an audited manifest, a
/// scenario, a chaos script, a PEM bundle, a call graph).
pub const MAX_FILE: u64 = 16 * 1024 * 1024;

/// The longest line of a streamed input (a recorded trace): 1 MiB.
pub const MAX_LINE: usize = 1024 * 1024;

/// Reads the regular file at `path`, at most `limit` bytes.
pub fn read(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let meta = std::fs::metadata(path)?;
    regular(&meta)?;
    too_large(meta.len(), limit)?;
    let file = open_nonblocking(path)?;
    // Checked again on the handle: the path may have changed since.
    let meta = file.metadata()?;
    regular(&meta)?;
    too_large(meta.len(), limit)?;
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    // One byte past the limit tells a file that grew (or a /proc file whose size is 0) apart.
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    too_large(bytes.len() as u64, limit)?;
    Ok(bytes)
}

/// Reads the regular file at `path` as UTF-8 text, at most `limit` bytes.
pub fn read_to_string(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read(path, limit)?)
        .map_err(|e| io::Error::new(ErrorKind::InvalidData, format!("is not UTF-8 text ({e})")))
}

/// Opens `path` to be read as a stream: a regular file or a FIFO (a pipe from another
/// process; opening one waits for its writer, as a pipe should). A directory, a socket or a
/// device is refused. Read it with [`read_line`].
pub fn open_stream(path: &Path) -> io::Result<File> {
    let meta = std::fs::metadata(path)?;
    if !is_fifo(&meta) {
        regular(&meta)?;
    }
    File::open(path)
}

/// Reads one line into `buf` (cleared first), with its `\n` if it has one; returns the bytes
/// read (0 at the end of the input). A line longer than `limit` bytes (without its `\n`) is an
/// `InvalidData` error, raised as soon as the limit is passed: nothing past it is kept.
pub fn read_line<R: BufRead + ?Sized>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    limit: usize,
) -> io::Result<usize> {
    buf.clear();
    loop {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(buf.len());
        }
        let (take, ends) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len(), false),
        };
        let content = buf.len() + take - usize::from(ends);
        if content > limit {
            return Err(io::Error::new(
                ErrorKind::InvalidData,
                format!("a line is longer than {}", size(limit as u64)),
            ));
        }
        buf.extend_from_slice(&available[..take]);
        reader.consume(take);
        if ends {
            return Ok(buf.len());
        }
    }
}

/// `16 MiB`, `1 KiB`, `100 bytes`.
pub fn size(bytes: u64) -> String {
    const MIB: u64 = 1024 * 1024;
    match bytes {
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= 1024 && b % 1024 == 0 => format!("{} KiB", b / 1024),
        b => format!("{b} bytes"),
    }
}

fn too_large(len: u64, limit: u64) -> io::Result<()> {
    if len > limit {
        return Err(io::Error::new(
            ErrorKind::FileTooLarge,
            format!("is larger than {}, the most stormguard reads from one file", size(limit)),
        ));
    }
    Ok(())
}

/// Refuses anything but a regular file, naming what it is.
fn regular(meta: &Metadata) -> io::Result<()> {
    let t = meta.file_type();
    if t.is_file() {
        return Ok(());
    }
    if t.is_dir() {
        return Err(io::Error::new(ErrorKind::IsADirectory, "is a directory, not a file"));
    }
    Err(io::Error::new(ErrorKind::InvalidInput, format!("is {}, not a regular file", kind(meta))))
}

#[cfg(unix)]
fn kind(meta: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

#[cfg(not(unix))]
fn kind(_: &Metadata) -> &'static str {
    "a special file"
}

#[cfg(unix)]
fn is_fifo(meta: &Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    meta.file_type().is_fifo()
}

#[cfg(not(unix))]
fn is_fifo(_: &Metadata) -> bool {
    false
}

/// Opens for reading without blocking in `open` (a FIFO put at the path after it was checked
/// would otherwise wait for a writer); a regular file reads the same either way.
#[cfg(unix)]
fn open_nonblocking(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> io::Result<File> {
    File::open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_file_within_the_limit_and_refuses_a_larger_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.toml");
        std::fs::write(&path, "cap = 20\n").unwrap();
        assert_eq!(read_to_string(&path, 9).unwrap(), "cap = 20\n");
        let e = read_to_string(&path, 8).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::FileTooLarge);
        assert_eq!(
            e.to_string(),
            "is larger than 8 bytes, the most stormguard reads from one file"
        );
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert_eq!(read_to_string(&path, 9).unwrap_err().kind(), ErrorKind::InvalidData);
    }

    #[test]
    fn refuses_directories() {
        let dir = tempfile::tempdir().unwrap();
        let e = read(dir.path(), MAX_FILE).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IsADirectory);
        assert_eq!(open_stream(dir.path()).unwrap_err().kind(), ErrorKind::IsADirectory);
    }

    #[cfg(unix)]
    #[test]
    fn refuses_devices_and_fifos_without_blocking() {
        let zero = Path::new("/dev/zero");
        let e = read(zero, MAX_FILE).unwrap_err();
        assert_eq!(
            (e.kind(), e.to_string().as_str()),
            (ErrorKind::InvalidInput, "is a character device, not a regular file")
        );
        assert_eq!(open_stream(zero).unwrap_err().kind(), ErrorKind::InvalidInput);
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        // No writer: std::fs::read would block in open forever.
        let e = read(&fifo, MAX_FILE).unwrap_err();
        assert_eq!(e.to_string(), "is a FIFO, not a regular file");
    }

    #[test]
    fn lines_are_bounded() {
        let text = b"short\nexactly8\nmuch too long for eight\nlast";
        let mut r = io::BufReader::with_capacity(4, &text[..]);
        let mut buf = Vec::new();
        assert_eq!(read_line(&mut r, &mut buf, 8).unwrap(), 6);
        assert_eq!(buf, b"short\n");
        read_line(&mut r, &mut buf, 8).unwrap();
        assert_eq!(buf, b"exactly8\n");
        let e = read_line(&mut r, &mut buf, 8).unwrap_err();
        assert_eq!(e.to_string(), "a line is longer than 8 bytes");
        // /dev/zero has no newline at all: refused after the limit, not read forever.
        let mut zeros = io::BufReader::new(io::repeat(0));
        assert_eq!(
            read_line(&mut zeros, &mut buf, 1024).unwrap_err().kind(),
            ErrorKind::InvalidData
        );
        let mut r = io::BufReader::new(&b"last"[..]);
        assert_eq!(read_line(&mut r, &mut buf, 8).unwrap(), 4);
        assert_eq!(read_line(&mut r, &mut buf, 8).unwrap(), 0);
    }
}
