//! What the cli tests share (`mod support;`): the binary, and files written for it.
#![allow(dead_code)] // each test file uses its own subset

use std::path::PathBuf;

use assert_cmd::Command;

/// `stormguard` as built for these tests.
pub fn stormguard() -> Command {
    Command::cargo_bin("stormguard").unwrap()
}

/// This test binary's own scratch directory (`stormguard-<test>-<pid>` under the temp dir).
pub fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "stormguard-{}-{}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `text` written to `name` in [`dir`].
pub fn write(name: &str, text: &str) -> PathBuf {
    let path = dir().join(name);
    std::fs::write(&path, text).unwrap();
    path
}
