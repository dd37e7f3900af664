//! Examples crate; programs live in examples/*.rs.
