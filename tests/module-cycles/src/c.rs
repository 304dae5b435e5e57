//! A fixture for scripts/module-cycles.py: `c` imports `b`; `b` names `c` only in a doc link
//! and a test module, so `b` and `c` form no circle. Not compiled.
pub struct C(pub crate::b::B);
