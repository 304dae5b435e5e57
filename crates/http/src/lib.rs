//! # stormguard-http
//!
//! What a dependency says over HTTP, turned into stormguard-core's terms: how long it asked us
//! to wait ([`headers`]), which `retry_on` condition a response or error is ([`classify`]),
//! whether a request may be sent twice ([`classify::is_idempotent`]), whether another layer
//! already retried it ([`stacked`]), and a request body that can be sent again ([`body`]).
//! No server and no client: the tower layer and the proxy use it.

#![warn(missing_docs)]

pub mod body;
pub mod classify;
pub mod headers;
pub mod provider;
pub mod rate;
pub mod stacked;
pub mod tree;
