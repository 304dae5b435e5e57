//! One module per subcommand.

pub mod audit;
pub mod chaos;
pub mod demo;
pub mod load;
pub mod plan;
pub mod proxy;
pub mod replay;
pub mod simulate;
