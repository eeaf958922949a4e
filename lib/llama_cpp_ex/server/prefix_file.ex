defmodule LlamaCppEx.Server.PrefixFile do
  @moduledoc false
  # The file `Server.save_prefix/4` writes and `Server.load_prefix/3` reads: an Erlang term
  # holding the prefix's tokens and cache scope, the model it was computed with, and the KV
  # snapshot's byte form (whose own header the engine checks). The model is identified by its
  # shape, size and a hash of its metadata, so a file computed with another model (another
  # fine-tune of the same shape included, when its metadata differs) is refused.

  import Bitwise
  alias LlamaCppEx.{Model, NIF}

  @format :llama_cpp_ex_prefix
  @version 1

  @spec write(Path.t(), Model.t(), [non_neg_integer()], term(), reference()) ::
          :ok | {:error, term()}
  def write(path, model, tokens, scope, snapshot) do
    with {:ok, kv} <- NIF.kv_snapshot_to_binary(snapshot) do
      term = %{
        format: @format,
        version: @version,
        model: fingerprint(model),
        scope: scope,
        tokens: tokens,
        kv: kv
      }

      File.write(path, :erlang.term_to_binary(term))
    end
  end

  @doc "`{:ok, %{tokens, scope, ref, bytes}}` from a file written for `model`."
  @spec read(Path.t(), Model.t()) :: {:ok, map()} | {:error, term()}
  def read(path, model) do
    with {:ok, bin} <- File.read(path),
         {:ok, term} <- decode(bin),
         :ok <- same_model(term, model),
         {:ok, {ref, bytes, len}} <- snapshot(term.kv),
         true <- len == length(term.tokens) || {:error, :invalid_prefix_file} do
      {:ok, %{tokens: term.tokens, scope: term.scope, ref: ref, bytes: bytes}}
    end
  end

  # `:safe`: a file must not create atoms or functions
  defp decode(bin) do
    case :erlang.binary_to_term(bin, [:safe]) do
      %{format: @format, version: @version, tokens: tokens, kv: kv, model: _, scope: _} = t
      when is_list(tokens) and is_binary(kv) ->
        if Enum.all?(tokens, &(is_integer(&1) and &1 >= 0)),
          do: {:ok, t},
          else: {:error, :invalid_prefix_file}

      _ ->
        {:error, :invalid_prefix_file}
    end
  rescue
    ArgumentError -> {:error, :invalid_prefix_file}
  end

  defp same_model(%{model: m}, model),
    do: if(m == fingerprint(model), do: :ok, else: {:error, :model_mismatch})

  defp snapshot(kv) do
    case NIF.kv_snapshot_from_binary(kv) do
      {:ok, s} -> {:ok, s}
      {:error, _} -> {:error, :invalid_prefix_file}
    end
  end

  defp fingerprint(model) do
    info = Model.info(model)

    info
    |> Map.take([:architecture, :desc, :n_vocab, :n_embd, :n_layer, :n_head, :n_head_kv])
    |> Map.merge(%{
      n_params: info.n_params,
      size: info.size,
      metadata: :erlang.phash2(model |> Model.metadata() |> Enum.sort(), 1 <<< 32)
    })
  end
end
