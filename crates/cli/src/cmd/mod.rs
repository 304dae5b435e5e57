//! One module per subcommand.

pub mod audit;
pub mod chaos;
pub mod chaos_scenario;
pub mod db_check;
pub mod demo;
pub mod load;
pub mod plan;
pub mod plan_systems;
pub mod proxy;
pub mod replay;
pub mod review;
pub mod simulate;
pub mod verify;
