//! PyTorch-compatible edges: safetensors files of every common dtype (written by the
//! `safetensors` crate's own serializer, as `safetensors.torch.save_file` writes them), i64 class
//! targets with `ignore_index = -100`, the exact and tanh GELU, and `load_state_dict`.
#![allow(clippy::unwrap_used)]

use half::{bf16, f16};
use rtx_tensor::checkpoint::{self, FileDType};
use rtx_tensor::nn::{Gpt, GptConfig, Linear, Module};
use rtx_tensor::{gradcheck, CrossEntropyOptions, DType, Error, GeluApprox, Generator, Reduction, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Writes `(name, dtype, shape, bytes)` with the safetensors crate's serializer.
fn write_raw(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors.iter().map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, path).unwrap();
}

fn le<T: Copy, const N: usize>(values: &[T], to_bytes: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| to_bytes(v)).collect()
}

#[test]
fn a_file_with_every_dtype_loads_exactly_and_saves_back_byte_for_byte() {
    // Goal: one file holding all ten common PyTorch dtypes (and U16/U32/U64) loads whole: each
    // tensor's values arrive exactly in its documented storage, the file dtypes are reported, and
    // saving with those dtypes reproduces every tensor's bytes. Method: write with the safetensors
    // crate, load, compare values, save back, re-read the raw views.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all.safetensors");
    let f16s = [f16::from_f32(-1.5), f16::MAX, f16::MIN_POSITIVE_SUBNORMAL];
    let bf16s = [bf16::from_f32(3.0), bf16::from_f32(-0.0078125)];
    let tensors = vec![
        ("a.i64", Dtype::I64, vec![2], le(&[i64::MIN, -100], i64::to_le_bytes)),
        ("b.i32", Dtype::I32, vec![3], le(&[i32::MIN, -7, i32::MAX], i32::to_le_bytes)),
        ("c.i16", Dtype::I16, vec![2], le(&[i16::MIN, 300], i16::to_le_bytes)),
        ("d.i8", Dtype::I8, vec![2], le(&[-128i8, 127], i8::to_le_bytes)),
        ("e.u8", Dtype::U8, vec![3], vec![0, 128, 255]),
        ("f.bool", Dtype::BOOL, vec![2, 2], vec![1, 0, 0, 1]),
        ("g.f16", Dtype::F16, vec![3], le(&f16s, f16::to_le_bytes)),
        ("h.bf16", Dtype::BF16, vec![2], le(&bf16s, bf16::to_le_bytes)),
        ("i.f32", Dtype::F32, vec![1, 2], le(&[0.1f32, -2.5], f32::to_le_bytes)),
        ("j.f64", Dtype::F64, vec![2], le(&[1e-300f64, 0.1], f64::to_le_bytes)),
        ("k.u32", Dtype::U32, vec![1], le(&[u32::MAX], u32::to_le_bytes)),
        ("l.u16", Dtype::U16, vec![1], le(&[u16::MAX], u16::to_le_bytes)),
        ("m.u64", Dtype::U64, vec![1], le(&[1u64 << 62], u64::to_le_bytes)),
    ];
    write_raw(&path, &tensors);

    let typed = checkpoint::load_tensors_with_dtypes(&path).unwrap();
    let got: BTreeMap<&str, &Tensor> = typed.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    assert_eq!(got.len(), tensors.len());
    assert_eq!(got["a.i64"].to_i64_vec().unwrap(), [i64::MIN, -100]);
    assert_eq!(got["b.i32"].to_i64_vec().unwrap(), [i64::from(i32::MIN), -7, i64::from(i32::MAX)]);
    assert_eq!(got["c.i16"].to_i64_vec().unwrap(), [-32768, 300]);
    assert_eq!(got["d.i8"].to_i64_vec().unwrap(), [-128, 127]);
    assert_eq!(got["e.u8"].to_i64_vec().unwrap(), [0, 128, 255]);
    assert_eq!((got["f.bool"].to_i64_vec().unwrap(), got["f.bool"].shape()), (vec![1, 0, 0, 1], &[2usize, 2][..]));
    assert_eq!(got["g.f16"].dtype(), DType::F32);
    assert_eq!(got["g.f16"].to_f32_vec().unwrap(), f16s.map(f32::from));
    assert_eq!((got["h.bf16"].dtype(), got["h.bf16"].to_f32_vec().unwrap()), (DType::BF16, vec![3.0, -0.0078125]));
    assert_eq!(got["i.f32"].to_f32_vec().unwrap(), [0.1, -2.5]);
    assert_eq!(got["j.f64"].to_f64_vec().unwrap(), [1e-300, 0.1]);
    assert_eq!(got["k.u32"].to_u32_vec().unwrap(), [u32::MAX]);
    assert_eq!(got["l.u16"].to_i64_vec().unwrap(), [65535]);
    assert_eq!(got["m.u64"].to_i64_vec().unwrap(), [1i64 << 62]);
    let file_dtypes: Vec<FileDType> = typed.file_dtypes.values().copied().collect();
    use FileDType::*;
    assert_eq!(file_dtypes, [I64, I32, I16, I8, U8, Bool, F16, BF16, F32, F64, U32, U16, U64]);

    // Saving back with the recorded dtypes gives the original bytes; without, the storage dtype.
    let back = dir.path().join("back.safetensors");
    checkpoint::save_tensors_as(&back, &typed.tensors, &typed.file_dtypes, &BTreeMap::new()).unwrap();
    let bytes = std::fs::read(&back).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, dtype, shape, raw) in &tensors {
        let view = st.tensor(name).unwrap();
        assert_eq!((view.dtype(), view.shape(), view.data()), (*dtype, &shape[..], &raw[..]), "{name}");
    }
    let plain = dir.path().join("plain.safetensors");
    checkpoint::save_tensors(&plain, &typed.tensors, &BTreeMap::new()).unwrap();
    let bytes = std::fs::read(&plain).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!((st.tensor("b.i32").unwrap().dtype(), st.tensor("g.f16").unwrap().dtype()), (Dtype::I64, Dtype::F32));
}

#[test]
fn values_that_do_not_fit_are_errors_naming_the_tensor() {
    // Goal: no silent narrowing. An I64 value outside I32 saved as I32, a U64 above i64::MAX,
    // a BOOL byte of 2, and an 8-bit float are each refused with the tensor's name, and a
    // refused save leaves no file. Method: provoke each through the public API.
    let dir = tempfile::tempdir().unwrap();
    let big = Tensor::from_vec(vec![1i64, 1 << 40], &[2]).unwrap();
    let out = dir.path().join("narrow.safetensors");
    let dtypes = BTreeMap::from([("targets".to_string(), FileDType::I32)]);
    let err = checkpoint::save_tensors_as(&out, &[("targets".into(), big)], &dtypes, &BTreeMap::new()).unwrap_err().to_string();
    assert!(err.contains("tensor targets cannot be saved as I32") && err.contains("1099511627776"), "{err}");
    assert!(!out.exists() && !dir.path().join("narrow.safetensors.tmp").exists());

    let cases: [(&str, Dtype, Vec<u8>, &str); 3] = [
        ("huge", Dtype::U64, u64::MAX.to_le_bytes().to_vec(), "above the I64 range"),
        ("flag", Dtype::BOOL, vec![0, 2], "not 0 or 1"),
        ("fp8", Dtype::F8_E4M3, vec![0], "unsupported dtype"),
    ];
    for (name, dtype, raw, why) in cases {
        let path = dir.path().join(format!("{name}.safetensors"));
        let n = raw.len() * 8 / dtype.bitsize();
        write_raw(&path, &[(name, dtype, vec![n], raw)]);
        let err = checkpoint::load_tensors(&path).unwrap_err().to_string();
        assert!(err.contains(&format!("tensor {name}")) && err.contains(why), "{err}");
    }

    // i64 used as u32 indices: a negative id is a typed error, not a wrapped index.
    let ids = Tensor::from_vec(vec![0i64, -3], &[2]).unwrap();
    assert!(matches!(ids.to_u32_vec(), Err(Error::IntegerOutOfRange { index: 1, value: -3, target: DType::U32, .. })));
    let table = Tensor::randn(&[4, 2], 0.0, 1.0, DType::F32, &mut Generator::new(0)).unwrap();
    assert!(matches!(Tensor::embedding(&table, &ids), Err(Error::IntegerOutOfRange { value: -3, .. })));
}

#[test]
fn i64_targets_with_ignore_index_match_pytorch() {
    // Goal: cross_entropy with i64 targets skips PyTorch's default ignore_index -100, means over
    // the counted rows, gives ignored rows zero gradient, equals the u32 result on the same
    // classes, and is NaN with zero gradient when every row is ignored (as torch). Method:
    // numbers from torch 2.x `F.cross_entropy` on these logits.
    let logits = Tensor::from_vec(vec![1.0f64, 2.0, 0.5, 0.0, -1.0, 3.0, 2.0, 2.0, 2.0], &[3, 3]).unwrap().requires_grad(true);
    let targets = Tensor::from_vec(vec![1i64, -100, 0], &[3]).unwrap();
    let loss = logits.cross_entropy(&targets, CrossEntropyOptions::default()).unwrap();
    // Row 0: lse(1, 2, .5) - 2; row 2: ln 3. Mean over the two counted rows.
    let lse0 = (1f64.exp() + 2f64.exp() + 0.5f64.exp()).ln();
    let want = ((lse0 - 2.0) + 3f64.ln()) / 2.0;
    assert!((loss.item().unwrap() - want).abs() < 1e-12, "{} vs {want}", loss.item().unwrap());
    loss.backward().unwrap();
    let g = logits.grad().unwrap().to_f64_vec().unwrap();
    assert_eq!(&g[3..6], &[0.0, 0.0, 0.0]);
    assert!((g[6] - (1.0 / 3.0 - 1.0) / 2.0).abs() < 1e-12);

    let as_u32 = Tensor::from_vec(vec![1u32, 2, 0], &[3]).unwrap();
    let only_counted = CrossEntropyOptions { reduction: Reduction::None, ..CrossEntropyOptions::default() };
    let (a, b) = (logits.cross_entropy(&targets, only_counted).unwrap().to_f64_vec().unwrap(), logits.cross_entropy(&as_u32, only_counted).unwrap().to_f64_vec().unwrap());
    assert_eq!((a[0], a[1], a[2]), (b[0], 0.0, b[2]));

    let all_ignored = Tensor::from_vec(vec![-100i64; 3], &[3]).unwrap();
    let x = logits.detach().requires_grad(true);
    let nan = x.cross_entropy(&all_ignored, CrossEntropyOptions::default()).unwrap();
    assert!(nan.item().unwrap().is_nan());
    nan.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), vec![0.0; 9]);
    let sum = CrossEntropyOptions { reduction: Reduction::Sum, ..CrossEntropyOptions::default() };
    assert_eq!(logits.cross_entropy(&all_ignored, sum).unwrap().item().unwrap(), 0.0);

    let err = logits.cross_entropy(&Tensor::from_vec(vec![0i64, -1, 0], &[3]).unwrap(), CrossEntropyOptions::default()).unwrap_err().to_string();
    assert!(err.contains("target -1 at row 1"), "{err}");
    let custom = CrossEntropyOptions { ignore_index: Some(2), ..CrossEntropyOptions::default() };
    assert!((logits.cross_entropy(&as_u32, custom).unwrap().item().unwrap() - want).abs() < 1e-12);
    let floats = Tensor::zeros(&[3], DType::F32);
    assert!(matches!(logits.cross_entropy(&floats, CrossEntropyOptions::default()), Err(Error::DTypeMismatch { .. })));
}

#[test]
fn gelu_exact_and_tanh_match_pytorch_values_and_finite_differences() {
    // Goal: `gelu()` is PyTorch's exact default and `gelu_with(Tanh)` its approximation, to the
    // digits torch prints in f64, both differentiate correctly, and the names parse. Method:
    // values from `F.gelu(x)` / `F.gelu(x, approximate="tanh")` in torch (f64), then gradcheck.
    let x = Tensor::from_vec(vec![-3.0f64, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0], &[7]).unwrap();
    let exact = [-0.00404969409489031, -0.15865525393145702, -0.15426876936299344, 0.0, 0.34573123063700656, 0.841344746068543, 2.99595030590511];
    let tanh = [-0.0036373920817729943, -0.15880800939172324, -0.15428599017485606, 0.0, 0.34571400982514394, 0.8411919906082768, 2.996362607918227];
    for (got, want) in x.gelu().unwrap().to_f64_vec().unwrap().iter().zip(exact) {
        assert!((got - want).abs() < 1e-15, "exact {got} vs {want}");
    }
    for (got, want) in x.gelu_with(GeluApprox::Tanh).unwrap().to_f64_vec().unwrap().iter().zip(tanh) {
        assert!((got - want).abs() < 1e-15, "tanh {got} vs {want}");
    }
    let x32 = x.to_dtype(DType::F32).unwrap().gelu().unwrap().to_f64_vec().unwrap();
    assert!(x32.iter().zip(exact).all(|(g, w)| (g - w).abs() < 1e-6), "{x32:?}");

    let seed = 17;
    println!("gradcheck seed {seed}");
    let input = Tensor::randn(&[4, 5], 0.0, 2.0, DType::F64, &mut Generator::new(seed)).unwrap().requires_grad(true);
    for approx in [GeluApprox::None, GeluApprox::Tanh] {
        let report = gradcheck(|t| t[0].gelu_with(approx)?.sum_all(), std::slice::from_ref(&input), 1e-6, 1e-6, seed).unwrap();
        assert!(report.max_abs_error < 1e-6, "{approx:?}: {report:?}");
    }
    assert_eq!(("tanh".parse::<GeluApprox>().unwrap(), "none".parse::<GeluApprox>().unwrap()), (GeluApprox::Tanh, GeluApprox::None));
    assert!(matches!("erf".parse::<GeluApprox>(), Err(Error::InvalidArgument { .. })));
}

#[test]
fn gpt_keeps_tanh_by_default_and_takes_the_exact_form_by_config() {
    // Goal: GptConfig::default() (GPT-2) keeps the tanh GELU, so every existing GPT keeps its
    // numbers, and `gelu: None` changes the output. Method: same init, both forms.
    assert_eq!(GptConfig::default().gelu, GeluApprox::Tanh);
    let config = GptConfig { vocab_size: 11, context: 8, d_model: 16, n_layers: 1, n_heads: 2, ..GptConfig::default() };
    let ids = Tensor::from_vec(vec![1u32, 5, 7, 2], &[1, 4]).unwrap();
    let tanh = Gpt::new(config, &mut Generator::new(3)).unwrap();
    let exact = Gpt::new(GptConfig { gelu: GeluApprox::None, ..config }, &mut Generator::new(3)).unwrap();
    let (a, b) = (tanh.forward(&ids, &mut Generator::new(0)).unwrap().to_f64_vec().unwrap(), exact.forward(&ids, &mut Generator::new(0)).unwrap().to_f64_vec().unwrap());
    let gap = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(gap > 0.0 && gap < 1e-2, "{gap}");
    let ids64 = ids.to_dtype(DType::I64).unwrap();
    assert_eq!(tanh.forward(&ids64, &mut Generator::new(0)).unwrap().to_f64_vec().unwrap(), a);
}

#[test]
fn load_state_dict_reports_by_name_and_copies_only_when_clean() {
    // Goal: load_state_dict lists missing, unexpected and shape-mismatched names; strict refuses
    // any of them and a shape mismatch is refused either way, leaving the module untouched; a
    // non-strict load copies what matches (converting F16-loaded F32 into F64 parameters); a
    // GPT rebuilt from another's state computes the same logits. Method: a Linear and two GPTs.
    let layer = Linear::new(3, 2, true, DType::F64, &mut Generator::new(1)).unwrap();
    let before = layer.weight.to_f64_vec().unwrap();
    let weight = Tensor::from_vec(vec![0.5f32; 6], &[2, 3]).unwrap();
    let state = vec![("weight".to_string(), weight.clone()), ("extra".to_string(), Tensor::zeros(&[1], DType::F32))];

    let err = layer.load_state_dict(&state, true).unwrap_err();
    let Error::StateDict { report } = &err else { panic!("{err}") };
    assert_eq!((report.missing.clone(), report.unexpected.clone()), (vec!["bias".to_string()], vec!["extra".to_string()]));
    assert_eq!(err.to_string(), "load_state_dict: missing keys: bias; unexpected keys: extra");
    assert_eq!(layer.weight.to_f64_vec().unwrap(), before);

    let report = layer.load_state_dict(&state, false).unwrap();
    assert_eq!((report.missing.len(), report.unexpected.len(), report.is_clean()), (1, 1, false));
    assert_eq!(layer.weight.to_f64_vec().unwrap(), vec![0.5; 6]);

    let wrong = vec![("weight".to_string(), Tensor::zeros(&[3, 2], DType::F32)), ("bias".to_string(), Tensor::zeros(&[2], DType::I64))];
    let err = layer.load_state_dict(&wrong, false).unwrap_err().to_string();
    assert!(err.contains("mismatched: bias (given [2] I64, module has [2] F64), weight (given [3, 2] F32, module has [2, 3] F64)"), "{err}");
    assert_eq!(layer.weight.to_f64_vec().unwrap(), vec![0.5; 6]);
    let twice = vec![("bias".to_string(), weight.clone()), ("bias".to_string(), weight)];
    assert!(matches!(layer.load_state_dict(&twice, false), Err(Error::InvalidArgument { .. })));

    let config = GptConfig { vocab_size: 11, context: 8, d_model: 16, n_layers: 2, n_heads: 2, ..GptConfig::default() };
    let source = Gpt::new(config, &mut Generator::new(5)).unwrap();
    let copy = Gpt::from_state_dict(config, &source.named_state()).unwrap();
    let ids = Tensor::from_vec(vec![3i64, 1, 4, 1, 5], &[1, 5]).unwrap();
    assert_eq!(copy.forward(&ids, &mut Generator::new(0)).unwrap().to_f64_vec().unwrap(), source.forward(&ids, &mut Generator::new(0)).unwrap().to_f64_vec().unwrap());
    let deeper = Gpt::from_state_dict(GptConfig { n_layers: 3, ..config }, &source.named_state()).unwrap_err().to_string();
    assert!(deeper.contains("missing keys: blocks.2.attn.proj.bias, blocks.2.attn.proj.weight"), "{deeper}");
}

/// A module with an integer buffer, as a PyTorch module with a `long` buffer.
struct Counted {
    weight: Tensor,
    ids: Tensor,
}

impl Module for Counted {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&rtx_tensor::nn::join_name(prefix, "weight"), &self.weight);
    }
    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        f(&rtx_tensor::nn::join_name(prefix, "weight"), &mut self.weight);
    }
    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&rtx_tensor::nn::join_name(prefix, "ids"), &self.ids);
    }
}

#[test]
fn integer_buffers_load_from_i64_with_a_range_check() {
    // Goal: an I64 tensor (what torch saves for a long buffer) loads into a u32 buffer when
    // every value fits, and a value that does not is a typed error that leaves the buffer as it
    // was. Method: a tiny module with a u32 buffer.
    let m = Counted { weight: Tensor::zeros(&[2], DType::F32).requires_grad(true), ids: Tensor::from_vec(vec![9u32, 9], &[2]).unwrap() };
    let good = vec![("weight".to_string(), Tensor::ones(&[2], DType::F32)), ("ids".to_string(), Tensor::from_vec(vec![4i64, 5], &[2]).unwrap())];
    assert!(m.load_state_dict(&good, true).unwrap().is_clean());
    assert_eq!(m.ids.to_u32_vec().unwrap(), [4, 5]);
    let bad = vec![("weight".to_string(), Tensor::ones(&[2], DType::F32)), ("ids".to_string(), Tensor::from_vec(vec![1i64, -1], &[2]).unwrap())];
    assert!(matches!(m.load_state_dict(&bad, true), Err(Error::IntegerOutOfRange { value: -1, .. })));
    assert_eq!(m.ids.to_u32_vec().unwrap(), [4, 5]);
}
