//! `memfold image build|list`.

use anyhow::Result;
use memfold_vm::images;

/// Builds the named profiles (all when none given), reusing cached ones.
pub fn build(names: &[String]) -> Result<()> {
    let cache = images::cache_dir();
    let all: Vec<String> = images::PROFILES
        .iter()
        .map(|p| p.name.to_string())
        .collect();
    let names = if names.is_empty() { &all } else { names };
    for n in names {
        images::profile(n)?;
    }
    for n in names {
        let t = std::time::Instant::now();
        let img = images::build(&cache, n, |line| {
            eprintln!("[{n}] {}", line.trim_start_matches("== step: "))
        })?;
        println!(
            "{n}: {} ({:.1} s)",
            img.kernel.parent().expect("in a folder").display(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Lists the profiles and whether each is built.
pub fn list() {
    let cache = images::cache_dir();
    for p in images::PROFILES {
        let state = if images::image(&cache, p.name).is_ok() {
            "built"
        } else {
            "not built"
        };
        println!(
            "{:<11} {:<9} {:<9} {:>4} MiB  {}",
            p.name,
            p.release.unwrap_or("-"),
            state,
            p.mem_mib,
            p.about
        );
    }
    println!("cache: {}", cache.display());
}
