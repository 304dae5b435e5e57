//! Every default of a dependency's rules, in one place.
//!
//! The library, the proxy, the simulator, `plan` and `audit` read their defaults from here, so
//! what `simulate` models with no settings is what the proxy does with none.

use std::time::Duration;

/// How long an attempt stormguard timed out (its per-try timeout, or the request's deadline)
/// keeps its slot while the dependency may still be working on it: the slot comes back when the
/// upstream answers, or when this passes, whichever is first. Long on purpose: a hold costs
/// nothing while the dependency answers, and one shorter than the dependency's slow answers
/// silently lets it see more than the cap. Never shortened to what was left of the deadline.
pub const TIMEOUT_SLOT_HOLD: Duration = Duration::from_secs(30);

/// How long an attempt whose caller went away (closed its connection, dropped the future)
/// keeps its slot while the dependency may still be working on it: as
/// [`TIMEOUT_SLOT_HOLD`], the slot comes back when the upstream answers, or at this bound,
/// when the attempt is cut and counted.
pub const ABANDON_HOLD: Duration = Duration::from_secs(30);
