//! A fixture for scripts/module-cycles.py (see `a.rs`). Not compiled. A doc link to
//! [`crate::c`] and a test module's `use crate::c` are no dependency.
pub struct B;

pub fn make() -> crate::a::A {
    crate::a::A(B)
}

#[cfg(test)]
mod tests {
    use crate::c::C;
}
