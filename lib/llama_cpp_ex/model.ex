defmodule LlamaCppEx.Model do
  @moduledoc """
  A model loaded from a GGUF file or a Hugging Face checkpoint directory: weights,
  hyper-parameters and the tokenizer (rebuilt from the GGUF metadata, or read from the
  checkpoint's `tokenizer.json`).

  Models are native resources freed by the garbage collector once no process references
  them; contexts and samplers keep their model alive.

  ## Example

      {:ok, model} = LlamaCppEx.Model.load("SmolLM2-135M-Instruct.Q4_1.gguf")
      LlamaCppEx.Model.desc(model)
      #=> "llama 135M Q4_1"

  ## Hugging Face checkpoints

  A directory in Hugging Face layout loads too: `config.json`, `model.safetensors` (or the
  shards named by `model.safetensors.index.json`), `tokenizer.json`, and when present
  `tokenizer_config.json` (chat template, BOS/EOS, `add_bos_token`), `chat_template.jinja` and
  `generation_config.json` (its `eos_token_id`s end generation). The `llama` (and `mistral`),
  `qwen2`, `qwen3` and `gemma3_text` model types are supported. The checkpoint is converted at
  load exactly as llama.cpp's `convert_hf_to_gguf.py` would convert it (tensor names, Llama's
  Q/K row order, Gemma's norms, Llama 3.1 rope factors). A decoder's matrices are quantized on
  the way (`:quantize`, default `:q8_0`), so it runs on the same kernels as a GGUF file; an
  encoder (BERT) keeps its stored precision by default, so its vectors are the ones
  sentence-transformers computes.

      {:ok, model} = LlamaCppEx.Model.load("/models/Qwen2.5-0.5B-Instruct", quantize: :q4_k)

  ## Placement

  In a CUDA build (`LLAMA_BACKEND=cuda`) on a machine with an NVIDIA GPU, `:n_gpu_layers`
  (default 99) and `:main_gpu` (default 0) decide where a decoder runs: 0 → the CPU; every
  layer (a value ≥ the model's layers, or -1) → GPU `:main_gpu`, weights in their GGUF type
  and the KV cache in GPU memory (f16; quantized KV types and KV snapshots are errors there).
  Part of the layers is an error: splitting a model between host and GPU is not implemented.
  A CPU build, or a machine without a GPU, runs on the CPU whatever they say, as llama.cpp
  does, and so does an encoder (BERT): only decoders have a GPU path.
  `LlamaCppEx.Model.backend/1` says where a model runs.

  ## Options that do nothing here

  `llama_cpp_ex`'s other placement and file-access options are accepted so that code written
  for it runs unchanged, and have no effect: `:split_mode` (still validated), `:tensor_split`, `:devices` (weights stay in host memory;
  a name that is not one of `LlamaCppEx.devices/0` is an error, as in `llama_cpp_ex`),
  `:use_mmap`, `:use_mlock`, `:use_direct_io` (the file is always memory-mapped and its pages
  released once copied), `:check_tensors` (every tensor's bounds are always checked) and
  `:load_mtp` (no MTP heads). `:rpc_servers` other than `[]` is an error: remote devices are
  not supported.
  """

  alias LlamaCppEx.{NIF, Options}

  @enforce_keys [:ref]
  defstruct [:ref, load_mtp: false]

  @type t :: %__MODULE__{ref: reference(), load_mtp: boolean()}

  @split_modes [none: 0, layer: 1, row: 2, tensor: 3]
  @int32 2_147_483_647
  @tuning_keys [
    :main_gpu,
    :split_mode,
    :tensor_split,
    :use_mmap,
    :use_mlock,
    :use_direct_io,
    :check_tensors,
    :rpc_servers,
    :devices
  ]
  @structural_keys [:n_gpu_layers, :vocab_only, :load_mtp]
  @own_keys [:requantize, :quantize]

  @doc "Load options that tune placement (forwarded by `LlamaCppEx.Server`)."
  @spec tuning_option_keys() :: [atom()]
  def tuning_option_keys, do: @tuning_keys

  @doc "Load options that change what is loaded."
  @spec structural_option_keys() :: [atom()]
  def structural_option_keys, do: @structural_keys

  @doc "Every option `load/2` accepts."
  @spec option_keys() :: [atom()]
  def option_keys, do: @tuning_keys ++ @structural_keys ++ @own_keys

  @doc """
  Loads a GGUF model.

  ## Options

    * `:requantize` - `true` (default) re-quantizes weight types that would otherwise run on
      scalar kernels to Q8_0 (only when the engine's own kernels are disabled with
      `LLAMA_CPP_EX_KERNELS=candle`); `:all` converts every quantized type to Q8_0 (more
      memory); `false` keeps the file's types.
    * `:vocab_only` - load only the tokenizer and the chat template. Default `false`.
    * `:quantize` - for Hugging Face checkpoint directories, the type their matrices are
      stored in after loading: `:q8_0` (the default for decoders), `:q4_0`, `:q4_k` (rows
      whose length is not a multiple of 256 fall back to Q8_0), or `:none` (as stored: f32,
      f16 or bf16; the default for BERT encoders). Q8_0 and
      Q4_0 round exactly as llama.cpp's quantizers do. GGUF files keep their own types, so
      for them this option is a documented no-op (see `:requantize`).
    * the options listed under "Options that do nothing here".

  Returns `{:ok, model}` or `{:error, message}`; a missing file, a directory, a truncated or
  hostile file and an unsupported architecture are all errors.
  """
  @spec load(Path.t(), keyword()) :: {:ok, t()} | {:error, String.t()}
  def load(path, opts \\ []) do
    Options.validate!(opts, option_keys(), "LlamaCppEx.Model.load/2")
    _ = encode_split_mode(Keyword.get(opts, :split_mode, :none))

    with :ok <- check_path(path),
         :ok <- check_devices(Keyword.get(opts, :devices, [])),
         :ok <-
           Options.check_all(opts,
             vocab_only: :boolean,
             load_mtp: :boolean,
             requantize: {:in, [true, false, :all]},
             quantize: {:in, [:q8_0, :q4_0, :q4_k, :none]},
             n_gpu_layers: {:int, -@int32, @int32},
             main_gpu: {:int, 0, @int32}
           ),
         :ok <- check_rpc(Keyword.get(opts, :rpc_servers, [])),
         {:ok, ref} <-
           NIF.model_load(
             path,
             requantize(opts),
             Keyword.get(opts, :vocab_only, false),
             # absent: the architecture's default, which only the loader knows
             opts |> Keyword.get(:quantize, :default) |> Atom.to_string(),
             {Keyword.get(opts, :n_gpu_layers, 99), Keyword.get(opts, :main_gpu, 0)}
           ) do
      {:ok, %__MODULE__{ref: ref, load_mtp: Keyword.get(opts, :load_mtp, false)}}
    end
  end

  defp check_path(path) do
    if is_binary(path) and String.valid?(path) and not String.contains?(path, <<0>>),
      do: :ok,
      else: {:error, "failed to load model from: #{inspect(path)} (path must be a string)"}
  end

  # placement is host memory whatever is named, but a name that is not a device is a typo the
  # contract refuses
  defp check_devices([]), do: :ok

  defp check_devices(names) when is_list(names) do
    available = Enum.map(LlamaCppEx.devices(), & &1.name)

    case Enum.find(names, &(&1 not in available)) do
      nil -> :ok
      name -> {:error, "unknown device: #{name} (available: #{Enum.join(available, ", ")})"}
    end
  end

  defp check_devices(other),
    do: {:error, "invalid :devices #{inspect(other)}, expected a list of device names"}

  @doc false
  # What `path` holds for the loader: a GGUF file, a checkpoint directory (`config.json`
  # inside), or neither. One answer for `load/2`'s callers that check before loading.
  @spec source_kind(term()) :: :file | :checkpoint | :missing
  def source_kind(path) when is_binary(path) do
    cond do
      File.regular?(path) -> :file
      File.regular?(Path.join(path, "config.json")) -> :checkpoint
      true -> :missing
    end
  end

  def source_kind(_), do: :missing

  defp check_rpc([]), do: :ok
  defp check_rpc(nil), do: :ok

  # as llama_cpp_ex without ggml-rpc answers (LlamaCppEx.RPC)
  defp check_rpc([endpoint | _]),
    do:
      {:error, "RPC endpoint #{inspect(endpoint)}: rpc_unsupported (this engine has no ggml-rpc)"}

  defp check_rpc(other), do: {:error, "invalid :rpc_servers #{inspect(other)}"}

  defp requantize(opts) do
    case Keyword.get(opts, :requantize, true) do
      :all -> :all
      true -> :scalar
      false -> :off
    end
  end

  @doc false
  @spec encode_split_mode(term()) :: 0..3
  def encode_split_mode(mode) when is_atom(mode) do
    case Keyword.fetch(@split_modes, mode) do
      {:ok, code} -> code
      :error -> raise_split_mode(mode)
    end
  end

  def encode_split_mode(mode), do: raise_split_mode(mode)

  defp raise_split_mode(mode) do
    raise ArgumentError,
          "unknown split_mode #{inspect(mode)}, expected :none, :layer, :row or :tensor"
  end

  @doc false
  # Hyper-parameters and vocabulary facts in one map (see native/nif/src/model.rs).
  @spec info(t()) :: map()
  def info(%__MODULE__{ref: ref}), do: NIF.model_info(ref)

  @doc """
  Where the model computes: `"CPU"`, or the GPU's device name (`"CUDA0"`) in a CUDA build.
  """
  @spec backend(t()) :: String.t()
  def backend(model), do: info(model).backend

  @doc "Context length the model was trained with."
  @spec n_ctx_train(t()) :: pos_integer()
  def n_ctx_train(model), do: info(model).n_ctx_train

  @doc "Hidden size."
  @spec n_embd(t()) :: pos_integer()
  def n_embd(model), do: info(model).n_embd

  @doc "Width of the model's output vectors (equals `n_embd/1` for these models)."
  @spec n_embd_out(t()) :: pos_integer()
  def n_embd_out(model), do: info(model).n_embd

  @doc "Number of transformer blocks."
  @spec n_layer(t()) :: pos_integer()
  def n_layer(model), do: info(model).n_layer

  @doc "Number of multi-token-prediction layers (always 0: no MTP head support)."
  @spec n_layer_nextn(t()) :: 0
  def n_layer_nextn(%__MODULE__{}), do: 0

  @doc "Number of parameters (elements of all tensors)."
  @spec n_params(t()) :: non_neg_integer()
  def n_params(model), do: info(model).n_params

  @doc "Size of the weights in the file, in bytes."
  @spec size(t()) :: non_neg_integer()
  def size(model), do: info(model).size

  @doc ~S'A short description such as `"llama 135M Q4_1"`.'
  @spec desc(t()) :: String.t()
  def desc(model), do: info(model).desc

  @doc "The architecture name from the file (`\"llama\"`, `\"gemma3\"`, ...)."
  @spec architecture(t()) :: String.t()
  def architecture(model), do: info(model).architecture

  @doc "The Jinja chat template embedded in the file, or `nil`."
  @spec chat_template(t()) :: String.t() | nil
  def chat_template(%__MODULE__{ref: ref}) do
    case NIF.model_chat_template(ref) do
      {template, true, _, _} -> template
      {_, false, _, _} -> nil
    end
  end

  @doc "Scalar GGUF metadata as a map of strings (arrays such as the vocabulary are left out)."
  @spec metadata(t()) :: %{String.t() => String.t()}
  def metadata(%__MODULE__{ref: ref}), do: ref |> NIF.model_metadata() |> Map.new()
end
