defmodule LlamaCppEx.Chat do
  @moduledoc """
  Chat prompt rendering with the model's Jinja chat template (`tokenizer.chat_template` in the
  GGUF), rendered natively with minijinja: loops, namespaces, `raise_exception`,
  `strftime_now`, `tojson`, Python string methods, `add_generation_prompt`, `enable_thinking`
  and extra `chat_template_kwargs`. Models whose file carries no template get a built-in one
  chosen by architecture (Gemma's turn format, else ChatML).

  ## Example

      {:ok, prompt} =
        LlamaCppEx.Chat.apply_template(model, [
          %{role: "system", content: "You are terse."},
          %{role: "user", content: "Hi!"}
        ])
  """

  alias LlamaCppEx.{Model, NIF, Options}

  @keys [:add_assistant, :enable_thinking, :chat_template_kwargs]

  @doc "Options `apply_template/3` accepts."
  @spec option_keys() :: [atom()]
  def option_keys, do: @keys

  @type message ::
          %{required(:role) => term(), required(:content) => term()}
          | %{required(String.t()) => term()}
          | {term(), term()}

  @doc """
  Renders `messages` (maps with atom or string keys, or `{role, content}` tuples).

  ## Options

    * `:add_assistant` - end with the assistant turn's opening. Default `true`.
    * `:enable_thinking` - passed to the template. Default `true`.
    * `:chat_template_kwargs` - extra template variables, `[{key, value}]`.
  """
  @spec apply_template(Model.t(), [message()], keyword()) ::
          {:ok, String.t()} | {:error, String.t()}
  def apply_template(%Model{ref: ref}, messages, opts \\ []) do
    Options.validate!(opts, @keys, "LlamaCppEx.Chat.apply_template/3")

    with {:ok, msgs} <- normalize(messages),
         {:ok, kwargs} <- encode_kwargs(Keyword.get(opts, :chat_template_kwargs, [])) do
      NIF.chat_apply_template(
        ref,
        msgs,
        Keyword.get(opts, :add_assistant, true),
        Keyword.get(opts, :enable_thinking, true),
        kwargs
      )
    end
  end

  defp normalize(messages) when is_list(messages) do
    Enum.reduce_while(messages, {:ok, []}, fn m, {:ok, acc} ->
      case message(m) do
        {:ok, pair} -> {:cont, {:ok, [pair | acc]}}
        :error -> {:halt, {:error, "chat template failed: invalid message #{inspect(m)}"}}
      end
    end)
    |> case do
      {:ok, acc} -> {:ok, Enum.reverse(acc)}
      error -> error
    end
  end

  defp normalize(other),
    do: {:error, "chat template failed: messages must be a list, got #{inspect(other)}"}

  defp message(%{role: r, content: c}), do: {:ok, {to_string(r), to_string(c)}}
  defp message(%{"role" => r, "content" => c}), do: {:ok, {to_string(r), to_string(c)}}
  defp message({r, c}), do: {:ok, {to_string(r), to_string(c)}}
  defp message(_), do: :error

  defp encode_kwargs(kwargs) when is_list(kwargs) or is_map(kwargs) do
    {:ok, Enum.map(kwargs, fn {k, v} -> {to_string(k), LlamaCppEx.JSON.encode!(v)} end)}
  rescue
    e in ArgumentError -> {:error, "chat template failed: #{Exception.message(e)}"}
  end

  defp encode_kwargs(other),
    do:
      {:error, "chat template failed: chat_template_kwargs must be a list, got #{inspect(other)}"}
end
