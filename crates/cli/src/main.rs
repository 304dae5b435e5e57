//! The `stormguard` binary: parse arguments, run, exit with the command's code.

fn main() -> std::process::ExitCode {
    stormguard::main_with_args(std::env::args_os())
}
