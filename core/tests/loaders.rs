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

/// A LIBSVM file loads as bags: indices as rows, values as weights, labels in ascending order as
/// classes, the last eighth held out; comments and blank lines are skipped.
#[test]
fn a_libsvm_file_loads_as_bags() {
    let dir = Scratch::new("libsvm-good");
    let path = dir.join("a.svm");
    let mut text = String::from("# a comment\n\n");
    for i in 0..16 {
        let label = if i % 2 == 0 { "-1" } else { "+1" };
        text.push_str(&format!("{label} {}:0.5 {}:2 # trailing\n", i + 1, 30 + i % 3));
    }
    text.push_str("+1 7:1.5 8:1 9:1\n");
    std::fs::write(&path, text).unwrap();
    let d: DataSource = format!("libsvm:{}", path.display()).parse().unwrap();
    let data = d.load(0).unwrap();
    assert_eq!(data.classes, 2);
    assert_eq!(data.input, gradsync_core::model::Input::Bag { rows: 33, slots: 3 });
    assert_eq!(data.train.len() + data.test.len(), 17);
    assert_eq!(data.test.len(), 2);
    // The first sample: label -1 is class 0; ids 1 and 30, weights 0.5 and 2, one empty slot.
    assert_eq!(data.train.y[0], 0);
    assert_eq!(&data.train.x[..6], &[1.0, 30.0, -1.0, 0.5, 2.0, 0.0]);
    // The last line held out: three ids.
    let last = &data.test.x[data.test.x.len() - 6..];
    assert_eq!(last, &[7.0, 8.0, 9.0, 1.5, 1.0, 1.0]);
}

/// A bad line is refused with the file and its line number, saying what was wrong.
#[test]
fn a_bad_libsvm_line_is_refused_by_file_and_line() {
    let dir = Scratch::new("libsvm-bad");
    for (body, want) in [
        ("1 1:1\nx 2:1\n", "line 2: label 'x' is not a number"),
        ("1 1:1\n0 2-1\n", "line 2: '2-1' is not INDEX:VALUE"),
        ("1 1:1\n0 -3:1\n", "line 2: index '-3' is not a whole number"),
        ("1 1:1\n0 99999999:1\n", "line 2: index '99999999' is not a whole number below 16777216"),
        ("1 1:1\n\n0 2:nan\n", "line 3: value 'nan' of index 2 is not a number"),
        ("1 1:1\n0\n", "line 2: no features"),
        ("1 1:1\n1 2:1\n", "every sample has the same label"),
        ("1 1:1\n", "1 samples; need at least 2"),
    ] {
        let path = dir.join("bad.svm");
        std::fs::write(&path, body).unwrap();
        let d: DataSource = format!("libsvm:{}", path.display()).parse().unwrap();
        let err = d.load(0).unwrap_err().to_string();
        assert!(err.contains(want) && err.contains("bad.svm"), "{body:?}: {err}");
    }
    let missing: DataSource = "libsvm:/nonexistent/x.svm".parse().unwrap();
    assert!(missing.load(0).unwrap_err().to_string().contains("/nonexistent/x.svm"));
    assert!("libsvm".parse::<DataSource>().unwrap_err().to_string().contains("libsvm:FILE"));
}

/// The built-in clicks: deterministic by seed, ids below the rows, 10 to 40 of them a sample,
/// the classes balanced, Zipf-skewed (the most popular id in many samples).
#[test]
fn the_clicks_generator_is_deterministic_balanced_and_skewed() {
    let d: DataSource = "clicks:4096:50000".parse().unwrap();
    let (a, b) = (d.load(3).unwrap(), d.load(3).unwrap());
    assert_eq!(a, b);
    assert_ne!(a.train.x, d.load(4).unwrap().train.x);
    let slots = 40;
    let mut counts = std::collections::HashMap::new();
    for s in a.train.x.chunks(2 * slots) {
        let ids: Vec<f32> = s[..slots].iter().copied().filter(|&i| i >= 0.0).collect();
        assert!((10..=40).contains(&ids.len()), "{} ids", ids.len());
        for &i in &ids {
            assert!(i < 50000.0 && i.fract() == 0.0);
            *counts.entry(i as u32).or_insert(0usize) += 1;
        }
    }
    let ones = a.train.y.iter().filter(|&&y| y == 1).count() as f64 / a.train.len() as f64;
    assert!((0.45..0.55).contains(&ones), "{ones}");
    let top = counts.values().max().copied().unwrap() as f64 / a.train.len() as f64;
    assert!(top > 1.0, "the most popular id appears {top} times a sample");
    assert!("clicks:0".parse::<DataSource>().is_err());
    assert!("clicks:10:99999999".parse::<DataSource>().unwrap_err().to_string().contains("16777216"));
}
