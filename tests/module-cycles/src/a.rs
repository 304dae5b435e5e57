//! A fixture for scripts/module-cycles.py: `a` and `b` import each other, which the check must
//! report. Not compiled.
use crate::b::B;

pub struct A(pub B);
