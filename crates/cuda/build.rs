//! Compiles the CUDA kernels ahead of time when `nvcc` is available: one fatbin with
//! sm_90a machine code plus compute_90 PTX (so newer GPUs can JIT it). Without nvcc the
//! crate still builds, and the kernels are compiled at run time with NVRTC.
//!
//! nvcc is looked up in `$DS4_NVCC`, `$NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, then
//! `PATH`. With `DS4_REQUIRE_NVCC=1` (CI) a missing nvcc is an error, so every kernel is
//! compile-checked.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let kernels = Path::new("kernels");
    println!("cargo:rerun-if-changed=kernels");
    for v in [
        "DS4_NVCC",
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "PATH",
        "DS4_REQUIRE_NVCC",
        "DS4_CUDA_ARCHS",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo::rustc-check-cfg=cfg(ds4_fatbin)");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    // One translation unit: the shared header, then every kernel file in name order.
    let source = kernel_source(kernels);
    let src_path = out.join("ds4_kernels.cu");
    fs::write(&src_path, &source).expect("write kernel source");

    let fatbin = out.join("ds4_kernels.fatbin");
    let require = env::var("DS4_REQUIRE_NVCC").is_ok_and(|v| v == "1");
    match find_nvcc() {
        Some(nvcc) => {
            let archs = env::var("DS4_CUDA_ARCHS").unwrap_or_else(|_| "90a".into());
            let mut cmd = Command::new(&nvcc);
            cmd.arg("-fatbin")
                .arg("-O3")
                .arg("-std=c++17")
                .arg("-lineinfo");
            for a in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
                cmd.arg(format!("-gencode=arch=compute_{a},code=sm_{a}"));
            }
            // Portable PTX for GPUs newer than the machine code above.
            cmd.arg("-gencode=arch=compute_90,code=compute_90");
            cmd.arg("-o").arg(&fatbin).arg(&src_path);
            let status = cmd
                .status()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
            if !status.success() {
                panic!("nvcc failed to compile the ds4 CUDA kernels ({status})");
            }
            println!("cargo:rustc-cfg=ds4_fatbin");
            println!(
                "cargo:warning=ds4-cuda: kernels compiled ahead of time with {}",
                nvcc.display()
            );
        }
        None if require => {
            panic!("DS4_REQUIRE_NVCC=1 but no nvcc was found (set DS4_NVCC or CUDA_HOME)")
        }
        None => {
            fs::write(&fatbin, b"").expect("write empty fatbin");
        }
    }
}

fn kernel_source(dir: &Path) -> String {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .expect("kernels directory")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    let mut src = fs::read_to_string(dir.join("common.cuh")).expect("kernels/common.cuh");
    for f in files {
        let text = fs::read_to_string(&f).expect("kernel file");
        src.push_str(&format!("\n// ---- {}\n", f.display()));
        for line in text.lines() {
            if !line.trim_start().starts_with("#include \"common.cuh\"") {
                src.push_str(line);
                src.push('\n');
            }
        }
    }
    src
}

fn find_nvcc() -> Option<PathBuf> {
    let exe = if cfg!(windows) { "nvcc.exe" } else { "nvcc" };
    for var in ["DS4_NVCC", "NVCC"] {
        if let Ok(p) = env::var(var) {
            let p = PathBuf::from(p);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = env::var(var) {
            let p = Path::new(&home).join("bin").join(exe);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|d| d.join(exe))
            .find(|p| p.is_file())
    })
}
