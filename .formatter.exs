[
  inputs: ["{mix,.formatter}.exs", "{config,lib,mix,test,bench}/**/*.{ex,exs}"]
]
