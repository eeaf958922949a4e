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

  ## Messages

  A message is a map with atom or string keys, or a `{role, content}` tuple. The role is a
  string or an atom; the content a string, `nil`, or structured parts (a list or map, e.g.
  `[%{type: "text", text: "..."}]`), and any other field (`tool_calls`, `name`,
  `tool_call_id`, ...) reaches the template as it is. Everything must be valid UTF-8 and
  representable as JSON; anything else is `{:error, "chat template failed: ..."}`.

  ## Untrusted templates

  A template comes from the model file, which may come from the internet. It is rendered in a
  separate OS process (a small helper started with the application, restarted when needed)
  with minijinja's fuel, an output limit and a value-nesting limit (`LlamaCppEx.Limits`),
  under a 2 GiB address-space limit and a 10 s deadline: a hostile template fails its own
  request with `{:error, "chat template failed: ..."}`, and never the node.
  """

  alias LlamaCppEx.{JSON, Limits, Model, NIF, Options}
  alias LlamaCppEx.Chat.Renderer

  @keys [:add_assistant, :enable_thinking, :chat_template_kwargs]

  @doc "Options `apply_template/3` accepts."
  @spec option_keys() :: [atom()]
  def option_keys, do: @keys

  @type message ::
          %{required(:role) => term(), required(:content) => term()}
          | %{required(String.t()) => term()}
          | {term(), term()}

  @doc """
  Renders `messages`.

  ## Options

    * `:add_assistant` - end with the assistant turn's opening. Default `true`.
    * `:enable_thinking` - passed to the template. Default `true`.
    * `:chat_template_kwargs` - extra template variables, a keyword list or map; they may set
      `enable_thinking` (as in llama.cpp), not `messages`, `add_generation_prompt`,
      `bos_token` or `eos_token`.
  """
  @spec apply_template(Model.t(), [message()], keyword()) ::
          {:ok, String.t()} | {:error, String.t()}
  def apply_template(%Model{ref: ref}, messages, opts \\ []) do
    Options.validate!(opts, @keys, "LlamaCppEx.Chat.apply_template/3")

    with :ok <- Options.check_all(opts, add_assistant: :boolean, enable_thinking: :boolean),
         {:ok, msgs} <- normalize(messages),
         {:ok, kwargs} <- kwargs(Keyword.get(opts, :chat_template_kwargs, [])),
         {:ok, request} <- request(ref, msgs, kwargs, opts) do
      Renderer.render(request)
    end
  end

  defp request(ref, messages, kwargs, opts) do
    {template, _own, bos, eos} = NIF.model_chat_template(ref)
    limits = Limits.get()

    payload = %{
      "template" => template,
      "messages" => messages,
      "add_generation_prompt" => Keyword.get(opts, :add_assistant, true),
      "enable_thinking" => Keyword.get(opts, :enable_thinking, true),
      "bos_token" => bos,
      "eos_token" => eos,
      "kwargs" => kwargs,
      "limits" =>
        Map.take(limits, [:template_fuel, :template_output_bytes, :template_value_depth]),
      "deadline_ms" => Renderer.deadline_ms()
    }

    {:ok, JSON.encode!(payload)}
  rescue
    e in ArgumentError -> {:error, "chat template failed: #{Exception.message(e)}"}
  end

  defp normalize(messages) when is_list(messages) do
    Enum.reduce_while(messages, {:ok, []}, fn m, {:ok, acc} ->
      case message(m) do
        {:ok, msg} ->
          {:cont, {:ok, [msg | acc]}}

        {:error, why} ->
          {:halt, {:error, "chat template failed: invalid message #{inspect(m)}: #{why}"}}
      end
    end)
    |> case do
      {:ok, acc} -> {:ok, Enum.reverse(acc)}
      error -> error
    end
  end

  defp normalize(other),
    do: {:error, "chat template failed: messages must be a list, got #{inspect(other)}"}

  defp message({role, content}), do: message(%{"role" => role, "content" => content})

  defp message(%{} = m) do
    fields = Map.new(m, fn {k, v} -> {to_key(k), v} end)

    with {:ok, role} <- role(Map.get(fields, "role")),
         :ok <- content(Map.get(fields, "content", :missing)),
         :ok <- encodable(fields) do
      {:ok, Map.put(fields, "role", role)}
    end
  end

  defp message(_), do: {:error, "expected a map or a {role, content} tuple"}

  defp to_key(k) when is_atom(k), do: Atom.to_string(k)
  defp to_key(k), do: k

  defp role(r) when is_atom(r) and not is_nil(r) and not is_boolean(r),
    do: {:ok, Atom.to_string(r)}

  defp role(r) when is_binary(r) do
    if String.valid?(r), do: {:ok, r}, else: {:error, "the role is not valid UTF-8"}
  end

  defp role(r), do: {:error, "the role must be a string or an atom, got #{inspect(r)}"}

  defp content(:missing), do: {:error, "no content"}
  defp content(_), do: :ok

  defp encodable(fields) do
    JSON.encode!(fields)
    :ok
  rescue
    e in ArgumentError -> {:error, Exception.message(e)}
  end

  defp kwargs(kwargs) when is_list(kwargs) or is_map(kwargs) do
    Enum.reduce_while(kwargs, {:ok, %{}}, fn
      {k, v}, {:ok, acc} when is_atom(k) or is_binary(k) ->
        {:cont, {:ok, Map.put(acc, to_string(k), v)}}

      other, _ ->
        {:halt,
         {:error, "chat template failed: bad chat_template_kwargs entry #{inspect(other)}"}}
    end)
  end

  defp kwargs(other),
    do:
      {:error,
       "chat template failed: chat_template_kwargs must be a list or map, got #{inspect(other)}"}
end
