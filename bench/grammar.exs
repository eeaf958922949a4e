# Cost of constrained generation: grammar time per sampling step (llguidance, off the
# GenServer, on the engine's sampling step), how many steps needed a full token mask and what
# those cost, and tok/s with and without a grammar, on both models.
#
#   [LLAMA_THREADS=2] mix run bench/grammar.exs
#
# Models come from the cache scripts/fetch_models.py fills (LLAMA_CPP_EX_MODELS overrides).

alias LlamaCppEx.{Chat, Context, Sampler, Tokenizer}

defmodule Bench.Grammar do
  @models_dir System.get_env("LLAMA_CPP_EX_MODELS") ||
                Path.join(System.user_home!(), ".cache/llama_cpp_ex/models")

  def models do
    [
      {"SmolLM2-135M Q4_1 (49k vocab)",
       Path.join(@models_dir, "SmolLM2-135M-Instruct.Q4_1.gguf")},
      {"Gemma 3 270M Q4_K_M (262k vocab)", Path.join(@models_dir, "gemma-3-270m-q4_k_m.gguf")}
    ]
  end

  def cases do
    person = %{
      "type" => "object",
      "properties" => %{
        "name" => %{"type" => "string", "maxLength" => 24},
        "age" => %{"type" => "integer", "minimum" => 0, "maximum" => 120},
        "email" => %{"type" => "string", "format" => "email"},
        "tags" => %{
          "type" => "array",
          "items" => %{"type" => "string", "maxLength" => 12},
          "maxItems" => 3
        }
      },
      "required" => ["name", "age", "tags"],
      "additionalProperties" => false
    }

    [
      {"none", [], "Write a short story about a robot."},
      {"json_schema person", [json_schema: person], "Describe a person as JSON."},
      {"gbnf list",
       [
         grammar: ~S"""
         root ::= item{3,5}
         item ::= "- " [A-Za-z ]{1,30} "\n"
         """
       ], "List a few fruits."}
    ]
  end

  # Greedy steps check the argmax; sampled steps (top_k 40, the default) check the best
  # candidates; both compute a full mask only when the grammar rejects too many of them.
  def samplings do
    [{"greedy", [temp: 0.0]}, {"temp 0.8", [temp: 0.8, seed: 42]}]
  end

  def run(threads) do
    for {label, path} <- models(), File.exists?(path) do
      {:ok, model} = LlamaCppEx.load_model(path)
      IO.puts("\n## #{label}\n")

      IO.puts(
        "| constraint | sampling | tokens | tok/s (incl. prefill) | grammar µs/step | full masks | mask mean µs | mask max µs |"
      )

      IO.puts("|---|---|---|---|---|---|---|---|")

      for {name, opts, question} <- cases(), {mode, sampling} <- samplings() do
        opts =
          case opts[:json_schema] do
            nil -> opts
            schema -> [grammar: LlamaCppEx.Grammar.json_schema_constraint!(schema)]
          end

        {:ok, prompt} = Chat.apply_template(model, [%{role: "user", content: question}])
        {:ok, tokens} = Tokenizer.encode(model, prompt)
        {:ok, ctx} = Context.create(model, n_ctx: 1024, n_threads: threads)
        {:ok, sampler} = Sampler.create(model, sampling ++ opts)
        # prefill outside the timed part: decode only
        {us, {:ok, text}} =
          :timer.tc(fn -> Context.generate(ctx, sampler, tokens, max_tokens: 96) end)

        {:ok, ids} = Tokenizer.encode(model, text, add_special: false)
        st = Sampler.grammar_stats(sampler)
        n = max(length(ids), 1)

        IO.puts(
          "| #{name} | #{mode} | #{n} | #{Float.round(n / (us / 1.0e6), 1)} | " <>
            "#{Float.round(st.step_mean_us, 1)} | #{st.masks}/#{st.steps} | " <>
            "#{Float.round(st.mask_mean_us, 1)} | #{Float.round(st.mask_max_us, 1)} |"
        )
      end
    end
  end
end

threads = String.to_integer(System.get_env("LLAMA_THREADS", "#{System.schedulers_online()}"))
Bench.Grammar.run(threads)
