//! Training-time augmentation of image batches: the notes' CIFAR-10 recipe, a random crop of
//! the image padded by `pad` zero pixels on every side, then a horizontal flip half the time
//! (`transforms.RandomCrop(32, padding=4)`, `RandomHorizontalFlip()`; the per-channel
//! normalisation is the loader's). Which crop and flip a sample gets depends on the seed, the
//! epoch and the sample's index alone, never on the rank that draws it, so a distributed run
//! augments every sample exactly as single-process training does.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::model::Input;
use crate::rng::Rng;

/// `--augment`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Augment {
    /// The data set's own default: crop-flip with 4 pixels for CIFAR-10, nothing otherwise.
    #[default]
    Auto,
    /// No augmentation.
    None,
    /// Random crop with this much zero padding, then a random horizontal flip.
    CropFlip {
        /// Pixels of padding on every side.
        pad: usize,
    },
}

impl FromStr for Augment {
    type Err = Error;

    /// `auto`, `none`, `crop-flip` (4 pixels) or `crop-flip:PAD`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Augment::Auto),
            "none" => Ok(Augment::None),
            "crop-flip" => Ok(Augment::CropFlip { pad: 4 }),
            _ => match s.strip_prefix("crop-flip:").map(str::parse::<usize>) {
                Some(Ok(pad)) => Ok(Augment::CropFlip { pad }),
                _ => Err(Error::invalid(
                    "augment",
                    format!("'{s}' (expected auto, none, crop-flip or crop-flip:PAD)"),
                )),
            },
        }
    }
}

impl fmt::Display for Augment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Augment::Auto => f.write_str("auto"),
            Augment::None => f.write_str("none"),
            Augment::CropFlip { pad } => write!(f, "crop-flip:{pad}"),
        }
    }
}

impl Augment {
    /// What `Auto` means for the data set `name` (crop-flip:4 for `cifar10`), and a refusal of
    /// cropping on flat data.
    pub fn resolve(self, name: &str, input: Input) -> Result<Augment> {
        let chosen = match self {
            Augment::Auto if name == "cifar10" => Augment::CropFlip { pad: 4 },
            Augment::Auto => Augment::None,
            other => other,
        };
        if let (Augment::CropFlip { .. }, Input::Flat(n)) = (chosen, input) {
            return Err(Error::invalid(
                "augment",
                format!("crop-flip needs images, but {name}'s samples are flat ({n} values)"),
            ));
        }
        Ok(chosen)
    }

    /// Augment the samples of `x` (rows of `input`, NCHW each) in place: sample `i` of the
    /// batch is data set sample `indices[i]`, drawn in `epoch` of a run seeded `seed`.
    pub fn apply(self, x: &mut [f32], input: Input, indices: &[usize], seed: u64, epoch: u64) {
        let (Augment::CropFlip { pad }, Input::Image { channels, height, width }) = (self, input) else {
            return;
        };
        let plane = height * width;
        let mut image = vec![0.0f32; channels * plane];
        for (sample, &index) in x.chunks_exact_mut(channels * plane).zip(indices) {
            let mut rng = Rng::new(seed ^ 0xA06_3E17, (epoch << 32) ^ index as u64);
            // The crop's top-left corner in the padded image, and the flip.
            let dy = rng.below(2 * pad as u64 + 1) as usize;
            let dx = rng.below(2 * pad as u64 + 1) as usize;
            let flip = rng.below(2) == 1;
            image.copy_from_slice(sample);
            for c in 0..channels {
                let (src, dst) = (&image[c * plane..][..plane], &mut sample[c * plane..][..plane]);
                for y in 0..height {
                    let sy = (y + dy).wrapping_sub(pad);
                    for xo in 0..width {
                        let xi = if flip { width - 1 - xo } else { xo };
                        let sx = (xi + dx).wrapping_sub(pad);
                        dst[y * width + xo] =
                            if sy < height && sx < width { src[sy * width + sx] } else { 0.0 };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMAGE: Input = Input::Image { channels: 2, height: 4, width: 5 };

    #[test]
    fn a_crop_is_a_shifted_window_of_the_padded_image_and_a_flip_mirrors_it() {
        let x: Vec<f32> = (1..=40).map(|v| v as f32).collect();
        for index in 0..50 {
            let mut y = x.clone();
            Augment::CropFlip { pad: 1 }.apply(&mut y, IMAGE, &[index], 7, 3);
            // Every value is zero (padding) or one of the image's own, same channel.
            for (i, &v) in y.iter().enumerate() {
                let channel = i / 20;
                assert!(v == 0.0 || ((v as usize - 1) / 20) == channel, "value {v} at {i}");
            }
            let mut again = x.clone();
            Augment::CropFlip { pad: 1 }.apply(&mut again, IMAGE, &[index], 7, 3);
            assert_eq!(y, again, "deterministic by seed, epoch and index");
        }
        // Without padding the crop is the image itself, flipped or not.
        let mut y = x.clone();
        Augment::CropFlip { pad: 0 }.apply(&mut y, IMAGE, &[1], 7, 0);
        let flipped: Vec<f32> = x.chunks(5).flat_map(|row| row.iter().rev().copied()).collect();
        assert!(y == x || y == flipped, "{y:?}");
        assert_eq!("crop-flip".parse::<Augment>().unwrap(), Augment::CropFlip { pad: 4 });
        assert!("crop".parse::<Augment>().is_err());
        assert!(Augment::CropFlip { pad: 4 }.resolve("synthetic", Input::Flat(8)).is_err());
        assert_eq!(Augment::Auto.resolve("cifar10", IMAGE).unwrap(), Augment::CropFlip { pad: 4 });
        assert_eq!(Augment::Auto.resolve("digits", IMAGE).unwrap(), Augment::None);
    }

    #[test]
    fn the_draw_depends_on_the_sample_not_on_the_batch_it_is_in() {
        let x: Vec<f32> = (0..80).map(|v| v as f32).collect();
        let mut pair = x.clone();
        Augment::CropFlip { pad: 2 }.apply(&mut pair, IMAGE, &[10, 11], 1, 2);
        let mut alone = x[40..].to_vec();
        Augment::CropFlip { pad: 2 }.apply(&mut alone, IMAGE, &[11], 1, 2);
        assert_eq!(&pair[40..], &alone[..]);
    }
}
