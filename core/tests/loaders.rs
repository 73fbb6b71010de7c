//! The MNIST and CIFAR-10 loaders: a good file loads; truncated files, wrong magic numbers,
//! image/label count mismatches and missing directories are clear errors naming the file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;

use gradsync_core::data::DataSource;
use gradsync_testkit::Scratch;

fn idx_images(n: u32, rows: u32, cols: u32, magic: u32) -> Vec<u8> {
    let mut b = Vec::new();
    for w in [magic, n, rows, cols] {
        b.extend_from_slice(&w.to_be_bytes());
    }
    b.extend((0..n * rows * cols).map(|i| (i % 251) as u8));
    b
}

fn idx_labels(n: u32) -> Vec<u8> {
    let mut b = Vec::new();
    for w in [2049u32, n] {
        b.extend_from_slice(&w.to_be_bytes());
    }
    b.extend((0..n).map(|i| (i % 10) as u8));
    b
}

fn write_mnist(dir: &Path, train_n: u32, gz: bool) {
    let put = |name: &str, bytes: Vec<u8>| {
        if gz {
            let f = std::fs::File::create(dir.join(format!("{name}.gz"))).unwrap();
            let mut e = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
            e.write_all(&bytes).unwrap();
            e.finish().unwrap();
        } else {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    };
    put("train-images-idx3-ubyte", idx_images(train_n, 28, 28, 2051));
    put("train-labels-idx1-ubyte", idx_labels(train_n));
    put("t10k-images-idx3-ubyte", idx_images(4, 28, 28, 2051));
    put("t10k-labels-idx1-ubyte", idx_labels(4));
}

fn load(spec: &str) -> Result<gradsync_core::data::Dataset, String> {
    spec.parse::<DataSource>().map_err(|e| e.to_string())?.load(0).map_err(|e| e.to_string())
}

#[test]
fn mnist_loads_raw_and_gz() {
    for gz in [false, true] {
        let d = Scratch::new(&format!("loader-ok{gz}"));
        write_mnist(&d, 12, gz);
        let ds = load(&format!("mnist:{}", d.display())).unwrap();
        assert_eq!((ds.train.len(), ds.test.len(), ds.dim, ds.classes), (12, 4, 784, 10));
        assert_eq!(ds.train.y[3], 3);
    }
}

#[test]
fn mnist_errors_name_the_file() {
    let d = Scratch::new("loader-trunc");
    write_mnist(&d, 12, false);
    let f = d.join("train-images-idx3-ubyte");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 100]).unwrap();
    let e = load(&format!("mnist:{}", d.display())).unwrap_err();
    assert!(e.contains("train-images-idx3-ubyte") && e.contains("truncated"), "{e}");

    std::fs::write(&f, idx_images(12, 28, 28, 2049)).unwrap();
    let e = load(&format!("mnist:{}", d.display())).unwrap_err();
    assert!(e.contains("train-images-idx3-ubyte") && e.contains("magic"), "{e}");

    std::fs::write(&f, idx_images(11, 28, 28, 2051)).unwrap();
    let e = load(&format!("mnist:{}", d.display())).unwrap_err();
    assert!(e.contains("train-labels-idx1-ubyte") && e.contains("12 labels for 11 images"), "{e}");

    std::fs::remove_file(d.join("t10k-labels-idx1-ubyte")).unwrap();
    std::fs::write(&f, idx_images(12, 28, 28, 2051)).unwrap();
    let e = load(&format!("mnist:{}", d.display())).unwrap_err();
    assert!(e.contains("t10k-labels-idx1-ubyte") && e.contains("missing"), "{e}");

    let e = load("mnist:/nonexistent/gradsync-data").unwrap_err();
    assert!(e.contains("/nonexistent/gradsync-data") && e.contains("no such directory"), "{e}");
}

#[test]
fn cifar_loads_and_rejects_bad_files() {
    let d = Scratch::new("loader-cifar");
    let record = |label: u8| {
        let mut r = vec![label];
        r.extend((0..3072).map(|i| (i % 256) as u8));
        r
    };
    for i in 1..=5 {
        std::fs::write(d.join(format!("data_batch_{i}.bin")), [record(1), record(2)].concat()).unwrap();
    }
    std::fs::write(d.join("test_batch.bin"), record(9)).unwrap();
    let ds = load(&format!("cifar10:{}", d.display())).unwrap();
    assert_eq!((ds.train.len(), ds.test.len(), ds.dim), (10, 1, 3072));

    let f = d.join("data_batch_3.bin");
    std::fs::write(&f, &record(1)[..1000]).unwrap();
    let e = load(&format!("cifar10:{}", d.display())).unwrap_err();
    assert!(e.contains("data_batch_3.bin") && e.contains("3073-byte records"), "{e}");

    std::fs::write(&f, record(12)).unwrap();
    let e = load(&format!("cifar10:{}", d.display())).unwrap_err();
    assert!(e.contains("data_batch_3.bin") && e.contains("label 12"), "{e}");

    std::fs::remove_file(&f).unwrap();
    let e = load(&format!("cifar10:{}", d.display())).unwrap_err();
    assert!(e.contains("data_batch_3.bin"), "{e}");

    let e = load("cifar10:").unwrap_err();
    assert!(e.contains("give the directory"), "{e}");
}
