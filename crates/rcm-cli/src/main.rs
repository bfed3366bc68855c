//! The `rcm` command.
mod capture;
mod netbuild;

fn main() {}
