//! One module per subcommand.

pub mod chaos;
pub mod load;
pub mod plan;
pub mod replay;
pub mod simulate;
