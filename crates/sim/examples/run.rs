//! Runs a built-in scenario (or a scenario file) and prints its table, or writes its HTML
//! report: `cargo run --release -p stormguard-sim --example run -- metastable [report.html]`.
//! (`stormguard simulate` is the command-line front end; this is the library's own.)
fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "metastable".to_string());
    let scenario: Result<_, Box<dyn std::error::Error>> = if name.ends_with(".toml") {
        stormguard_sim::Scenario::from_file(std::path::Path::new(&name)).map_err(Into::into)
    } else {
        stormguard_sim::builtin::scenario(&name).map_err(Into::into)
    };
    let scenario = scenario.unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let report = stormguard_sim::simulate(&scenario).expect("the built-in scenarios run");
    match args.next() {
        Some(path) => {
            std::fs::write(&path, stormguard_sim::html::render(&report)).expect("writes the report")
        }
        None => report.write_table(&mut std::io::stdout()).expect("writes to stdout"),
    }
}
