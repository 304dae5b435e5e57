//! (load)
