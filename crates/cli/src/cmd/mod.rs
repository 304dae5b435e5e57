//! One module per subcommand.

pub mod plan;
pub mod replay;
