defmodule LlamaCppEx.Model do
  @moduledoc """
  A model loaded from a GGUF file: weights, hyper-parameters and the tokenizer rebuilt from
  the file's metadata.

  Models are native resources freed by the garbage collector once no process references
  them; contexts and samplers keep their model alive.

  ## Example

      {:ok, model} = LlamaCppEx.Model.load("SmolLM2-135M-Instruct.Q4_1.gguf")
      LlamaCppEx.Model.desc(model)
      #=> "llama 135M Q4_1"
  """

  alias LlamaCppEx.{NIF, Options}

  @enforce_keys [:ref]
  defstruct [:ref, load_mtp: false]

  @type t :: %__MODULE__{ref: reference(), load_mtp: boolean()}

  @split_modes [none: 0, layer: 1, row: 2, tensor: 3]
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
  @own_keys [:requantize]

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
      scalar kernels to Q8_0 at load; Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 have the engine's own
      kernels, so this only applies when they are disabled (`LLAMA_CPP_EX_KERNELS=candle`). `:all` converts every quantized type (K-quants and Q4_1
      included) to Q8_0 so every product uses the Q8_0 kernel (more memory); `false` keeps
      the file's types.
    * `:vocab_only` - load only the tokenizer. Default `false`.
    * `:n_gpu_layers`, `:main_gpu`, `:split_mode`, `:tensor_split`, `:use_mmap`, `:use_mlock`,
      `:use_direct_io`, `:check_tensors`, `:load_mtp`, `:rpc_servers`, `:devices` - accepted
      for compatibility with `llama_cpp_ex`; the CPU engine reads the file through a memory
      map and ignores GPU placement. `:split_mode` is still validated.

  Returns `{:ok, model}` or `{:error, message}`; a missing file, a directory, a truncated or
  hostile file and an unsupported architecture are all errors.
  """
  @spec load(Path.t(), keyword()) :: {:ok, t()} | {:error, String.t()}
  def load(path, opts \\ []) do
    Options.validate!(opts, option_keys(), "LlamaCppEx.Model.load/2")
    _ = encode_split_mode(Keyword.get(opts, :split_mode, :none))

    cond do
      not is_binary(path) ->
        {:error, "failed to load model from: #{inspect(path)} (path must be a string)"}

      true ->
        requantize =
          case Keyword.get(opts, :requantize, true) do
            :all -> :all
            true -> :scalar
            _ -> :off
          end

        vocab_only = Keyword.get(opts, :vocab_only, false) == true

        case NIF.model_load(path, requantize, vocab_only) do
          {:ok, ref} ->
            {:ok, %__MODULE__{ref: ref, load_mtp: Keyword.get(opts, :load_mtp, false)}}

          {:error, _} = error ->
            error
        end
    end
  end

  @doc false
  @spec encode_split_mode(atom()) :: 0..3
  def encode_split_mode(mode) do
    case Keyword.fetch(@split_modes, mode) do
      {:ok, code} when is_atom(mode) ->
        code

      _ ->
        raise ArgumentError,
              "unknown split_mode #{inspect(mode)}, expected :none, :layer, :row or :tensor"
    end
  end

  @doc "Context length the model was trained with."
  @spec n_ctx_train(t()) :: pos_integer()
  def n_ctx_train(%__MODULE__{ref: ref}), do: NIF.model_n_ctx_train(ref)

  @doc "Hidden size."
  @spec n_embd(t()) :: pos_integer()
  def n_embd(%__MODULE__{ref: ref}), do: NIF.model_n_embd(ref)

  @doc "Width of the model's output vectors (equals `n_embd/1` for these models)."
  @spec n_embd_out(t()) :: pos_integer()
  def n_embd_out(%__MODULE__{ref: ref}), do: NIF.model_n_embd(ref)

  @doc "Number of transformer blocks."
  @spec n_layer(t()) :: pos_integer()
  def n_layer(%__MODULE__{ref: ref}), do: NIF.model_n_layer(ref)

  @doc "Number of multi-token-prediction layers (always 0: no MTP head support)."
  @spec n_layer_nextn(t()) :: 0
  def n_layer_nextn(%__MODULE__{}), do: 0

  @doc "Number of parameters (elements of all tensors)."
  @spec n_params(t()) :: pos_integer()
  def n_params(%__MODULE__{ref: ref}), do: NIF.model_n_params(ref)

  @doc "Size of the weights in the file, in bytes."
  @spec size(t()) :: non_neg_integer()
  def size(%__MODULE__{ref: ref}), do: NIF.model_size(ref)

  @doc ~S'A short description such as `"llama 135M Q4_1"`.'
  @spec desc(t()) :: String.t()
  def desc(%__MODULE__{ref: ref}), do: NIF.model_desc(ref)

  @doc "The architecture name from the file (`\"llama\"`, `\"gemma3\"`, ...)."
  @spec architecture(t()) :: String.t()
  def architecture(%__MODULE__{ref: ref}), do: NIF.model_architecture(ref)

  @doc "The Jinja chat template embedded in the file, or `nil`."
  @spec chat_template(t()) :: String.t() | nil
  def chat_template(%__MODULE__{ref: ref}) do
    case NIF.model_chat_template(ref) do
      "" -> nil
      template -> template
    end
  end

  @doc "Scalar GGUF metadata as a map of strings (arrays such as the vocabulary are left out)."
  @spec metadata(t()) :: %{String.t() => String.t()}
  def metadata(%__MODULE__{ref: ref}), do: ref |> NIF.model_metadata() |> Map.new()
end
